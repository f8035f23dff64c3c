// NVTX ranges that name qbl's stages in Nsight Systems (domain "qbl"): the layer's forward and
// backward and, inside them, the prologue, the GEMMs and the backward's element kernel. NVTX3 is
// header-only and ships with the CUDA Toolkit; with no profiler attached a range costs a check of
// a function pointer. Define QBL_DISABLE_NVTX (before including qbl, the same in every translation
// unit of a program) to compile the ranges out.
#pragma once

#if !defined(QBL_DISABLE_NVTX)
#include <nvtx3/nvToolsExt.h>
#endif

namespace qbl::detail {

#if !defined(QBL_DISABLE_NVTX)

/// qbl's NVTX domain, created on first use (one per process).
inline nvtxDomainHandle_t nvtx_domain() noexcept {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("qbl");
  return domain;
}

/// A range from construction to destruction on the calling host thread. `name` must outlive it
/// (a string literal).
class NvtxRange {
 public:
  explicit NvtxRange(const char* name) noexcept {
    nvtxEventAttributes_t a = {};
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = name;
    nvtxDomainRangePushEx(nvtx_domain(), &a);
  }
  ~NvtxRange() { nvtxDomainRangePop(nvtx_domain()); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

#else

class NvtxRange {
 public:
  explicit NvtxRange(const char*) noexcept {}
};

#endif

}  // namespace qbl::detail
