#include "diagnostics.h"

#include <cudnn_frontend.h>

namespace convbias {

std::vector<int64_t> cudnn_versions() {
  return {CUDNN_VERSION, static_cast<int64_t>(cudnnGetVersion()), CUDNN_FRONTEND_VERSION};
}

} // namespace convbias
