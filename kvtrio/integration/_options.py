"""The ``kvtrio.*`` options an engine passes to its kvtrio connector, validated.

vLLM hands them over in ``kv_connector_extra_config``; values may arrive as JSON types or as
strings (from a command line), so booleans and numbers are also read from their usual spellings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..errors import TransportError
from ..options import make_converter, one_of
from ..transport import check_endpoint

__all__ = ["OPTION_HELP", "ConnectorOptions", "opted_out", "parse_options", "request_switches"]

PREFIX = "kvtrio."

_converter = make_converter()  # the server's: the same spellings of numbers and booleans


def _optional_seconds(value: Any, _: Any) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    return float(_converter.structure(value, float))


_converter.register_structure_hook_func(lambda t: t == float | None, _optional_seconds)


def _endpoint(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    try:
        check_endpoint(value)
    except TransportError as exc:
        raise ValueError(f"{attribute.name}: {exc}") from None


def _seconds(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0 <= value < 3600:
        raise ValueError(f"{attribute.name}: expected 0 ≤ seconds < 3600, got {value!r}")


@attrs.frozen
class ConnectorOptions:
    """What a connector was told; ``metadata["help"]`` says what each option does."""

    url: str = attrs.field(
        default="tcp://127.0.0.1:5577",
        validator=_endpoint,
        metadata={"help": "the kvtrio server's endpoint (tcp://HOST:PORT or ipc://PATH)"},
    )
    model: str = attrs.field(
        default="",
        metadata={
            "help": "the name chunks are kept under (default: the engine's model name); give "
            "engines that load one model from different paths the same name"
        },
    )
    tenant: str = attrs.field(
        default="",
        metadata={"help": "a namespace: engines with different tenants never share chunks"},
    )
    server_key: str = attrs.field(
        default="",
        metadata={
            "help": "the server's CURVE public key or key file, for tcp:// (default: "
            "KVTRIO_SERVER_KEY, then this user's default keys; docs/security.md)"
        },
    )
    client_key: str = attrs.field(
        default="",
        metadata={
            "help": "this engine's CURVE .key_secret file (default: KVTRIO_CLIENT_KEY, then "
            "this user's default keys)"
        },
    )
    insecure: bool = attrs.field(
        default=False,
        metadata={
            "help": "connect without CURVE, to a server started with --insecure (default: "
            "KVTRIO_INSECURE)"
        },
    )
    keys: str = attrs.field(
        default="engine",
        validator=one_of("engine", "tokens"),
        metadata={
            "help": "engine: name chunks by vLLM's own block hashes (requests with a LoRA "
            "adapter, multimodal inputs, prompt embeddings or a cache_salt are cached too; "
            "every engine sharing a model needs the same PYTHONHASHSEED and "
            "prefix_caching_hash_algo); tokens: by token ids (such requests bypass kvtrio)"
        },
    )
    events: str = attrs.field(
        default="",
        metadata={
            "help": "the kvtrio server's KV events endpoint (its --events): relay its events "
            "for this tenant into vLLM's own KV event stream (docs/events.md)"
        },
    )
    load: bool = attrs.field(default=True, metadata={"help": "load hits from kvtrio"})
    save: bool = attrs.field(default=True, metadata={"help": "store computed chunks into kvtrio"})
    load_policy: str = attrs.field(
        default="auto",
        validator=one_of("auto", "always"),
        metadata={
            "help": "auto: load a hit (or only its L1 part) only when this engine's own "
            "measurements, the loads in flight and its prefill backlog say loading is faster "
            "than computing it; always: load every hit"
        },
    )
    load_failure: str = attrs.field(
        default="recompute",
        validator=one_of("recompute", "fail"),
        metadata={
            "help": "what vLLM does with a request whose load from kvtrio failed: recompute "
            "its blocks (kvtrio sets vLLM's kv_load_failure_policy to recompute, whose default "
            "is fail) or fail the request (vLLM's policy set to fail)"
        },
    )
    async_load: bool = attrs.field(
        default=True,
        metadata={
            "help": "load between engine steps, the request waiting meanwhile (false: load "
            "inside the step, before its forward)"
        },
    )
    timeout: float = attrs.field(
        default=5.0,
        validator=_seconds,
        metadata={"help": "seconds any request to kvtrio may take before it counts as failed"},
    )
    lookup_wait: float | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(_seconds),
        metadata={
            "help": "seconds the scheduler waits at most for a lookup's answer before moving on "
            "(the request is asked about again at the next step); auto (the default): a "
            "step's time shared by the requests the wait holds up (the engine's median step "
            "/ (1 + requests in it)), 1 ms to 0.5 s, 20 ms before the first step"
        },
    )


attrs.resolve_types(ConnectorOptions)  # field types as types, for the converter

OPTION_HELP: dict[str, str] = {
    PREFIX + field.name: field.metadata["help"] for field in attrs.fields(ConnectorOptions)
}
"""``kvtrio.<option>`` → one line of help."""


def parse_options(extra_config: Mapping[str, Any]) -> ConnectorOptions:
    """Read the ``kvtrio.*`` keys of ``extra_config`` (other keys belong to others), with the
    server's converter (:func:`kvtrio.options.make_converter`): strings as from a command line
    (``"false"``, ``"2.5"``), JSON values as they are.

    Raises ``ValueError`` naming every unknown ``kvtrio.*`` key (with the known ones) and every
    value that is wrong.
    """
    fields = {field.name: field for field in attrs.fields(ConnectorOptions)}
    given = {k[len(PREFIX) :]: v for k, v in extra_config.items() if k.startswith(PREFIX)}
    problems = [
        f"unknown option {PREFIX}{name} (known: {', '.join(sorted(OPTION_HELP))})"
        for name in sorted(set(given) - set(fields))
    ]
    values: dict[str, Any] = {}
    for name in sorted(set(given) & set(fields)):
        try:
            values[name] = _read(fields[name], given[name])
        except ValueError as exc:
            problems.append(f"{PREFIX}{exc}")
    if problems:
        raise ValueError("kvtrio connector options: " + "; ".join(problems))
    return ConnectorOptions(**values)


def _read(field: attrs.Attribute[Any], value: Any) -> Any:
    """One option's value, converted and validated; ``ValueError("NAME: problem")``."""
    try:
        converted = _converter.structure(value, field.type or str)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{field.name}: {exc}") from None
    if field.validator is not None:
        field.validator(None, field, converted)
    return converted


def request_switches(params: Mapping[str, Any] | None) -> tuple[bool | None, bool | None, str]:
    """``(load, save, problem)`` from a request's ``kv_transfer_params``: ``kvtrio.load`` and
    ``kvtrio.save``, None where not given; ``problem`` says what was ignored, if anything."""
    if not params:
        return None, None, ""
    switches: list[bool | None] = []
    problems = []
    for key in (PREFIX + "load", PREFIX + "save"):
        value = params.get(key)
        try:
            switches.append(None if value is None else _converter.structure(value, bool))
        except (ValueError, TypeError) as exc:
            switches.append(None)
            problems.append(f"{key}: {exc}")
    return switches[0], switches[1], "; ".join(problems)


def opted_out(request: Any) -> str:
    """Why ``request`` (a vLLM request) must not share KV through kvtrio's token-keyed chunks
    (token mode), or ''. In hash mode vLLM's block hashes tell such requests apart."""
    if request.cache_salt:
        return "it has a cache_salt"
    if request.lora_request is not None:
        return "it uses a LoRA adapter"
    if request.mm_features:
        return "it has multimodal inputs"
    if getattr(request, "prompt_embeds", None) is not None:
        return "it has prompt embeddings"
    return ""
