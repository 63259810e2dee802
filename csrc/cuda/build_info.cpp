#include "diagnostics.h"

#include <cudnn.h>
#include <cudnn_frontend_version.h>  // the version alone: the full frontend headers take a minute to compile

namespace convbias {

std::vector<int64_t> cudnn_versions() {
  return {CUDNN_VERSION, static_cast<int64_t>(cudnnGetVersion()), CUDNN_FRONTEND_VERSION};
}

} // namespace convbias
