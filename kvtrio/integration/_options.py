"""The ``kvtrio.*`` options an engine passes to its kvtrio connector, validated.

vLLM hands them over in ``kv_connector_extra_config``; values may arrive as JSON types or as
strings (from a command line), so booleans and numbers are also read from their usual spellings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["OPTION_HELP", "ConnectorOptions", "opted_out", "parse_options", "request_switches"]

PREFIX = "kvtrio."

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"expected true or false, got {value!r}")


def _to_seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number of seconds, got {value!r}") from None
    if not 0 <= seconds < 3600:
        raise ValueError(f"expected 0 ≤ seconds < 3600, got {value!r}")
    return seconds


def _to_str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _policy(value: Any) -> str:
    text = _to_str(value).strip().lower()
    if text not in ("auto", "always"):
        raise ValueError(f"expected auto or always, got {value!r}")
    return text


def _endpoint(value: Any) -> str:
    text = _to_str(value)
    if not text.startswith(("tcp://", "ipc://")) or text in ("tcp://", "ipc://"):
        raise ValueError(f"expected tcp://HOST:PORT or ipc://PATH, got {value!r}")
    return text


@attrs.frozen
class ConnectorOptions:
    """What a connector was told; ``metadata["help"]`` says what each option does."""

    url: str = attrs.field(
        default="tcp://127.0.0.1:5577",
        converter=_endpoint,
        metadata={"help": "the kvtrio server's endpoint (tcp://HOST:PORT or ipc://PATH)"},
    )
    model: str = attrs.field(
        default="",
        converter=_to_str,
        metadata={
            "help": "the name chunks are kept under (default: the engine's model name); give "
            "engines that load one model from different paths the same name"
        },
    )
    tenant: str = attrs.field(
        default="",
        converter=_to_str,
        metadata={"help": "a namespace: engines with different tenants never share chunks"},
    )
    server_key: str = attrs.field(
        default="",
        converter=_to_str,
        metadata={
            "help": "the server's CURVE public key or key file, for tcp:// (default: "
            "KVTRIO_SERVER_KEY, then this user's default keys; docs/security.md)"
        },
    )
    client_key: str = attrs.field(
        default="",
        converter=_to_str,
        metadata={
            "help": "this engine's CURVE .key_secret file (default: KVTRIO_CLIENT_KEY, then "
            "this user's default keys)"
        },
    )
    insecure: bool = attrs.field(
        default=False,
        converter=_to_bool,
        metadata={
            "help": "connect without CURVE, to a server started with --insecure (default: "
            "KVTRIO_INSECURE)"
        },
    )
    load: bool = attrs.field(
        default=True, converter=_to_bool, metadata={"help": "load hits from kvtrio"}
    )
    save: bool = attrs.field(
        default=True, converter=_to_bool, metadata={"help": "store computed chunks into kvtrio"}
    )
    load_policy: str = attrs.field(
        default="auto",
        converter=_policy,
        metadata={
            "help": "auto: load a hit only when this engine's own measurements say loading is "
            "faster than computing it; always: load every hit"
        },
    )
    async_load: bool = attrs.field(
        default=True,
        converter=_to_bool,
        metadata={
            "help": "load between engine steps, the request waiting meanwhile (false: load "
            "inside the step, before its forward)"
        },
    )
    timeout: float = attrs.field(
        default=5.0,
        converter=_to_seconds,
        metadata={"help": "seconds any request to kvtrio may take before it counts as failed"},
    )
    lookup_wait: float = attrs.field(
        default=0.02,
        converter=_to_seconds,
        metadata={
            "help": "seconds the scheduler waits for a lookup's answer before moving on (the "
            "request is asked about again at the next step)"
        },
    )


OPTION_HELP: dict[str, str] = {
    PREFIX + field.name: field.metadata["help"] for field in attrs.fields(ConnectorOptions)
}
"""``kvtrio.<option>`` → one line of help."""


def parse_options(extra_config: Mapping[str, Any]) -> ConnectorOptions:
    """Read the ``kvtrio.*`` keys of ``extra_config`` (other keys belong to others).

    Raises ``ValueError`` naming every unknown ``kvtrio.*`` key (with the known ones) and every
    value that is wrong.
    """
    known = {field.name for field in attrs.fields(ConnectorOptions)}
    given = {k[len(PREFIX) :]: v for k, v in extra_config.items() if k.startswith(PREFIX)}
    problems = [
        f"unknown option {PREFIX}{name} (known: {', '.join(sorted(OPTION_HELP))})"
        for name in sorted(set(given) - known)
    ]
    values: dict[str, Any] = {}
    for name in sorted(set(given) & known):
        field = getattr(attrs.fields(ConnectorOptions), name)
        try:
            values[name] = field.converter(given[name])
        except ValueError as exc:
            problems.append(f"{PREFIX}{name}: {exc}")
    if problems:
        raise ValueError("kvtrio connector options: " + "; ".join(problems))
    return ConnectorOptions(**values)


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
            switches.append(None if value is None else _to_bool(value))
        except ValueError as exc:
            switches.append(None)
            problems.append(f"{key}: {exc}")
    return switches[0], switches[1], "; ".join(problems)


def opted_out(request: Any) -> str:
    """Why ``request`` (a vLLM request) must not share KV through kvtrio's token-keyed chunks,
    or ''."""
    if request.cache_salt:
        return "it has a cache_salt"
    if request.lora_request is not None:
        return "it uses a LoRA adapter"
    if request.mm_features:
        return "it has multimodal inputs"
    if getattr(request, "prompt_embeds", None) is not None:
        return "it has prompt embeddings"
    return ""
