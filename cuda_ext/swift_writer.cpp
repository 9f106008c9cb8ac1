// ds-swift native message-log writer.
//
// append_record(): computes the payload's crc32c, patches it (and the header's own crc32c) into
// the packed record header that Python built, and appends header + payload to a file descriptor
// with writev - all without the GIL, so the training thread keeps running Python while the writer
// thread checksums and writes megabytes. The bytes are exactly those of the pure-Python writer
// (ds_swift/msglog/writer.py, PythonAppender); tests/unit/test_msglog_native.py checks that.
//
// With -DWITH_CUDA (only when torch sees CUDA at build time) the module also has D2HStager: a
// side stream that waits for the producing stream, copies logged tensors into a reusable pool
// of pinned host blocks, and an event per batch that the writer thread polls (no blocking sync
// on the training thread).

#include <torch/extension.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <sys/uio.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <nmmintrin.h>
#define DS_SWIFT_X86 1
#endif

namespace {

// ---------------------------------------------------------------- crc32c (Castagnoli)
uint32_t g_table[8][256];

void init_tables() {
  const uint32_t poly = 0x82F63B78u;  // reflected 0x1EDC6F41
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ poly : c >> 1;
    g_table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int t = 1; t < 8; ++t) g_table[t][i] = (g_table[t - 1][i] >> 8) ^ g_table[0][g_table[t - 1][i] & 0xFF];
}

uint32_t crc_sw(uint32_t crc, const uint8_t* p, size_t n) {
  crc = ~crc;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = (crc >> 8) ^ g_table[0][(crc ^ *p++) & 0xFF];
    --n;
  }
  while (n >= 8) {  // slicing-by-8
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= crc;
    crc = g_table[7][w & 0xFF] ^ g_table[6][(w >> 8) & 0xFF] ^ g_table[5][(w >> 16) & 0xFF] ^
          g_table[4][(w >> 24) & 0xFF] ^ g_table[3][(w >> 32) & 0xFF] ^ g_table[2][(w >> 40) & 0xFF] ^
          g_table[1][(w >> 48) & 0xFF] ^ g_table[0][(w >> 56) & 0xFF];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ g_table[0][(crc ^ *p++) & 0xFF];
  return ~crc;
}

#ifdef DS_SWIFT_X86
__attribute__((target("sse4.2"))) uint32_t crc_hw(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = ~crc & 0xFFFFFFFFu;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  // One dependent chain: ~8 bytes per 3 cycles, several GB/s, well above the disk's rate.
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  while (n--) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return ~static_cast<uint32_t>(c);
}

bool has_sse42() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  return (c & bit_SSE4_2) != 0;
}
const bool g_hw = has_sse42();
#endif

struct TableInit {
  TableInit() { init_tables(); }
} g_init;

uint32_t crc32c_impl(uint32_t crc, const uint8_t* p, size_t n) {
#ifdef DS_SWIFT_X86
  if (g_hw) return crc_hw(crc, p, n);
#endif
  return crc_sw(crc, p, n);
}

void put_u32le(std::string& s, size_t off, uint32_t v) {
  for (int i = 0; i < 4; ++i) s[off + i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}

const uint8_t* byte_ptr(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
  return static_cast<const uint8_t*>(t.data_ptr());
}

// ---------------------------------------------------------------- python-visible functions
int64_t crc32c_tensor(const torch::Tensor& data, int64_t value) {
  const uint8_t* p = byte_ptr(data, "data");
  const size_t n = static_cast<size_t>(data.numel()) * data.element_size();
  uint32_t crc;
  {
    py::gil_scoped_release nogil;
    crc = crc32c_impl(static_cast<uint32_t>(value), p, n);
  }
  return crc;
}

int64_t crc32c_bytes(const py::bytes& data, int64_t value) {
  std::string s = data;
  return crc32c_impl(static_cast<uint32_t>(value), reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// Returns (payload_crc, errno): errno 0 on success. Python raises OSError and truncates a torn
// record; throwing from here would lose the errno (ENOSPC must reach the caller as ENOSPC).
std::tuple<int64_t, int64_t> append_record(int64_t fd, const py::bytes& header_template, const torch::Tensor& payload,
                                           int64_t crc_offset) {
  std::string header = header_template;
  TORCH_CHECK(crc_offset >= 0 && static_cast<size_t>(crc_offset) + 4 <= header.size() - 4,
              "crc_offset out of range");
  const uint8_t* p = byte_ptr(payload, "payload");
  const size_t n = static_cast<size_t>(payload.numel()) * payload.element_size();
  uint32_t crc = 0;
  int err = 0;
  {
    py::gil_scoped_release nogil;
    crc = crc32c_impl(0, p, n);
    put_u32le(header, static_cast<size_t>(crc_offset), crc);
    const uint32_t hcrc = crc32c_impl(0, reinterpret_cast<const uint8_t*>(header.data()), header.size() - 4);
    put_u32le(header, header.size() - 4, hcrc);

    struct iovec iov[2];
    iov[0].iov_base = header.data();
    iov[0].iov_len = header.size();
    iov[1].iov_base = const_cast<uint8_t*>(p);
    iov[1].iov_len = n;
    int idx = 0;
    while (idx < 2) {
      if (iov[idx].iov_len == 0) {
        ++idx;
        continue;
      }
      ssize_t w = ::writev(static_cast<int>(fd), iov + idx, 2 - idx);
      if (w < 0) {
        if (errno == EINTR) continue;
        err = errno;
        break;
      }
      size_t left = static_cast<size_t>(w);
      while (idx < 2 && left >= iov[idx].iov_len) {
        left -= iov[idx].iov_len;
        iov[idx].iov_len = 0;
        ++idx;
      }
      if (idx < 2) {
        iov[idx].iov_base = static_cast<char*>(iov[idx].iov_base) + left;
        iov[idx].iov_len -= left;
      }
    }
  }
  return {static_cast<int64_t>(crc), static_cast<int64_t>(err)};
}

bool hardware_crc() {
#ifdef DS_SWIFT_X86
  return g_hw;
#else
  return false;
#endif
}

}  // namespace

#ifdef WITH_CUDA
void register_cuda(py::module& m);  // swift_writer_cuda.cpp
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds-swift native message-log writer (crc32c + writev without the GIL)";
  m.def("crc32c_tensor", &crc32c_tensor, "crc32c of a contiguous CPU tensor's bytes", py::arg("data"),
        py::arg("value") = 0);
  m.def("crc32c_bytes", &crc32c_bytes, "crc32c of bytes", py::arg("data"), py::arg("value") = 0);
  m.def("append_record", &append_record,
        "Patch crcs into a packed record header and append header + payload to fd; returns (crc, errno)",
        py::arg("fd"), py::arg("header_template"), py::arg("payload"), py::arg("crc_offset"));
  m.def("hardware_crc", &hardware_crc, "whether the SSE4.2 crc32 instruction is used");
#ifdef WITH_CUDA
  m.attr("with_cuda") = true;
  register_cuda(m);
#else
  m.attr("with_cuda") = false;
#endif
}
