/*
 * kvtrio_ext.cpp: the torch binding of the gather/scatter kernels, built at first use by
 * torch.utils.cpp_extension.load (kvtrio/transfer/_cuda_build.py) together with
 * kvtrio_kernels.cu. It checks its arguments, then queues one kernel on torch's current stream
 * of the chunk's device; it never synchronises.
 */
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kvtrio_index.h"
#include "kvtrio_kernels.h"

namespace {

void check(const torch::Tensor& t, const char* name, torch::ScalarType dtype, bool cuda) {
    TORCH_CHECK(t.scalar_type() == dtype, name, ": expected dtype ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), name, ": must be contiguous");
    TORCH_CHECK(t.is_cuda() == cuda, name, cuda ? ": must be a CUDA tensor" : ": must be a CPU tensor");
}

/* gather (engine -> chunk) or scatter (chunk -> engine) of one chunk, all layers at once. */
void copy(const torch::Tensor& geometry, int64_t pointer_bits, const torch::Tensor& bases,
          const torch::Tensor& ids, const torch::Tensor& chunk, bool gather) {
    check(geometry, "geometry", torch::kInt64, false);
    check(bases, "bases", torch::kInt64, true);
    check(ids, "ids", torch::kInt64, true);
    check(chunk, "chunk", torch::kUInt8, true);
    TORCH_CHECK(geometry.numel() == KVT_G_FIELDS, "geometry: expected ", KVT_G_FIELDS, " fields");
    TORCH_CHECK(bases.device() == chunk.device() && ids.device() == chunk.device(),
                "bases, ids and chunk must be on one device");
    kvt_plan plan;
    int rc = kvt_make_plan(geometry.data_ptr<int64_t>(), 0, &plan);
    TORCH_CHECK(rc == KVT_OK, kvt_error_message(rc));
    const int64_t expected = bases.numel() * kvt_layer_bytes(plan, ids.numel());
    TORCH_CHECK(chunk.numel() == expected, "chunk: expected ", expected, " bytes, got ", chunk.numel());

    const c10::cuda::CUDAGuard guard(chunk.device());
    const auto stream = c10::cuda::getCurrentCUDAStream(chunk.get_device());
    int cuda_error = 0;
    rc = kvt_cuda_copy(geometry.data_ptr<int64_t>(), (uint64_t)pointer_bits, bases.numel(),
                       reinterpret_cast<const uint64_t*>(bases.data_ptr<int64_t>()),
                       ids.data_ptr<int64_t>(), ids.numel(), chunk.data_ptr<uint8_t>(),
                       gather ? 1 : 0, static_cast<void*>(stream.stream()), &cuda_error);
    TORCH_CHECK(rc == KVT_OK, "kvtrio copy kernel: ", kvt_error_message(rc),
                rc == KVT_E_CUDA ? cudaGetErrorString(static_cast<cudaError_t>(cuda_error)) : "");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "kvtrio gather/scatter kernels between paged KV caches and contiguous chunks";
    m.def("copy", &copy, "Queue a gather or scatter of one chunk on the current stream",
          py::arg("geometry"), py::arg("pointer_bits"), py::arg("bases"), py::arg("ids"),
          py::arg("chunk"), py::arg("gather"));
}
