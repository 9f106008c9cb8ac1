// CUDA half of the ds-swift native writer; compiled only when torch has CUDA (-DWITH_CUDA).
//
// D2HStager copies logged device tensors to host memory off the critical path, as SWIFT section 6
// describes: the training thread calls stage() in a pipeline bubble, which only *enqueues* work:
// the side stream waits on an event recorded on the producing stream, copies each tensor into a
// pinned block from a pool (blocks are reused, so steady state does no cudaHostAlloc), and
// records a completion event. The writer thread polls ready() (cudaEventQuery, never a blocking
// sync), then take()s the host blocks, writes them, and give_back()s them to the pool.
// The device tensors are kept referenced until the copy is done: without that, the caching
// allocator could hand their memory to the next micro-batch while the copy still reads it.

#include <torch/extension.h>

// Only c10's stream/guard headers and the CUDA runtime: ATen/cuda/CUDAContext.h would pull in
// cuBLAS/cuSPARSE/cuSOLVER headers that a runtime-only toolkit lacks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

// A timing-free CUDA event, destroyed with its owner.
class Event {
 public:
  Event() { C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming)); }
  ~Event() { C10_CUDA_CHECK_WARN(cudaEventDestroy(ev_)); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(const c10::cuda::CUDAStream& s) { C10_CUDA_CHECK(cudaEventRecord(ev_, s.stream())); }
  void block(const c10::cuda::CUDAStream& s) { C10_CUDA_CHECK(cudaStreamWaitEvent(s.stream(), ev_, 0)); }
  bool query() {
    const cudaError_t err = cudaEventQuery(ev_);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not-ready is not an error; clear it
      return false;
    }
    C10_CUDA_CHECK(err);
    return true;
  }

 private:
  cudaEvent_t ev_ = nullptr;
};

int64_t size_class(int64_t n) {
  int64_t c = 4096;
  while (c < n) c <<= 1;
  return c;
}

struct Batch {
  std::vector<at::Tensor> device;  // kept alive until the copy completes
  std::vector<at::Tensor> blocks;  // pinned blocks (capacity = size class)
  std::vector<int64_t> nbytes;
  std::shared_ptr<Event> done;
};

class D2HStager {
 public:
  D2HStager(int64_t device, int64_t max_pool_bytes)
      : device_(static_cast<c10::DeviceIndex>(device)),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_)),
        max_pool_bytes_(max_pool_bytes) {}

  int64_t stage(const std::vector<at::Tensor>& tensors) {
    c10::cuda::CUDAGuard guard(device_);
    Batch b;
    Event produced;  // the side stream must not read before the producing stream wrote
    produced.record(c10::cuda::getCurrentCUDAStream(device_));
    produced.block(stream_);
    {
      c10::cuda::CUDAStreamGuard sguard(stream_);
      for (const auto& t : tensors) {
        TORCH_CHECK(t.is_cuda(), "D2HStager.stage expects CUDA tensors");
        at::Tensor src = t.contiguous().reshape({-1}).view(at::kByte);
        const int64_t n = src.numel();
        at::Tensor block = take_block(n);
        block.narrow(0, 0, n).copy_(src, /*non_blocking=*/true);
        b.device.push_back(src);
        b.blocks.push_back(block);
        b.nbytes.push_back(n);
      }
      b.done = std::make_shared<Event>();
      b.done->record(stream_);
    }
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t id = next_id_++;
    batches_.emplace(id, std::move(b));
    return id;
  }

  bool ready(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = batches_.find(id);
    TORCH_CHECK(it != batches_.end(), "unknown staging ticket ", id);
    return it->second.done->query();
  }

  // Host views (exact byte length) of a completed batch; the device tensors are released.
  std::vector<at::Tensor> take(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = batches_.find(id);
    TORCH_CHECK(it != batches_.end(), "unknown staging ticket ", id);
    TORCH_CHECK(it->second.done->query(), "staging ticket ", id, " is not complete");
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < it->second.blocks.size(); ++i)
      out.push_back(it->second.blocks[i].narrow(0, 0, it->second.nbytes[i]));
    batches_.erase(it);
    return out;
  }

  void give_back(const std::vector<at::Tensor>& views) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& v : views) {
      // A view's base is the pooled block; rebuild it from storage so the size class matches.
      at::Tensor block = at::empty({0}, v.options()).set_(v.storage(), 0, {static_cast<int64_t>(v.storage().nbytes())});
      const int64_t cap = block.numel();
      if (pooled_bytes_ + cap > max_pool_bytes_) continue;  // let it free: the pool stays bounded
      pool_[cap].push_back(block);
      pooled_bytes_ += cap;
    }
  }

  int64_t pooled_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return pooled_bytes_;
  }

 private:
  at::Tensor take_block(int64_t n) {
    const int64_t cap = size_class(n);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pool_.find(cap);
      if (it != pool_.end() && !it->second.empty()) {
        at::Tensor b = it->second.back();
        it->second.pop_back();
        pooled_bytes_ -= cap;
        return b;
      }
    }
    return at::empty({cap}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  }

  c10::DeviceIndex device_;
  c10::cuda::CUDAStream stream_;
  int64_t max_pool_bytes_;
  std::mutex mu_;
  int64_t next_id_ = 0;
  int64_t pooled_bytes_ = 0;
  std::unordered_map<int64_t, Batch> batches_;
  std::map<int64_t, std::vector<at::Tensor>> pool_;
};

}  // namespace

void register_cuda(py::module& m) {
  py::class_<D2HStager>(m, "D2HStager")
      .def(py::init<int64_t, int64_t>(), py::arg("device"), py::arg("max_pool_bytes"))
      .def("stage", &D2HStager::stage, "enqueue D2H copies of tensors on the side stream; returns a ticket")
      .def("ready", &D2HStager::ready, "whether the ticket's copies are complete (cudaEventQuery)")
      .def("take", &D2HStager::take, "host byte views of a completed ticket")
      .def("give_back", &D2HStager::give_back, "return host blocks to the pinned pool")
      .def("pooled_bytes", &D2HStager::pooled_bytes);
}
