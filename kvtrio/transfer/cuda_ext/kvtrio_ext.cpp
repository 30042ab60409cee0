/*
 * kvtrio_ext.cpp: the torch binding of the operation kernel, built at first use by
 * torch.utils.cpp_extension.load (kvtrio/transfer/_cuda_build.py) together with
 * kvtrio_kernels.cu.
 *
 * `run` takes plain integers (addresses, counts, the stream's handle), not tensors: the caller
 * (kvtrio/transfer/_cuda_torch.py) keeps the arrays alive, and a call costs about a microsecond
 * of argument conversion instead of a tensor check per argument. It checks the geometry, the
 * segments and the block ids, then queues the kernel on the given stream; it never
 * synchronises. `device_pointer` is the device address of page-locked host memory.
 */
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include "kvtrio_batch.h"
#include "kvtrio_kernels.h"

namespace {

/* Gather (engine -> segments) or scatter of a whole operation, one launch. */
void run(int64_t device, int64_t geometry, int64_t layer_bits, int64_t n_layers, int64_t bases,
         int64_t ids, int64_t n_ids, int64_t segments, int64_t n_segments, bool gather,
         int64_t stream) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    int cuda_error = 0;
    const int rc = kvt_cuda_run(
        reinterpret_cast<const int64_t*>(geometry), static_cast<uint64_t>(layer_bits), n_layers,
        reinterpret_cast<const uint64_t*>(bases), reinterpret_cast<const int32_t*>(ids), n_ids,
        reinterpret_cast<const kvt_segment*>(segments), n_segments, gather ? 1 : 0,
        reinterpret_cast<void*>(stream), &cuda_error);
    TORCH_CHECK(rc == KVT_OK, "kvtrio copy kernel: ", kvt_error_message(rc),
                rc == KVT_E_CUDA ? cudaGetErrorString(static_cast<cudaError_t>(cuda_error)) : "");
}

/* The device address of page-locked (registered or cudaHostAlloc'd) host memory. */
int64_t device_pointer(int64_t host) {
    void* pointer = nullptr;
    const cudaError_t err = cudaHostGetDevicePointer(&pointer, reinterpret_cast<void*>(host), 0);
    TORCH_CHECK(err == cudaSuccess, "cudaHostGetDevicePointer: ", cudaGetErrorString(err));
    return reinterpret_cast<int64_t>(pointer);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "kvtrio gather/scatter of whole operations between paged KV caches and chunks";
    m.def("run", &run, "Queue an operation's gather or scatter on a stream (one launch)",
          py::arg("device"), py::arg("geometry"), py::arg("layer_bits"), py::arg("n_layers"),
          py::arg("bases"), py::arg("ids"), py::arg("n_ids"), py::arg("segments"),
          py::arg("n_segments"), py::arg("gather"), py::arg("stream"));
    m.def("device_pointer", &device_pointer, "Device address of page-locked host memory",
          py::arg("host"));
    m.attr("MAX_SEGMENTS") = KVT_MAX_SEGMENTS;
    m.attr("MAX_IDS") = KVT_MAX_IDS;
}
