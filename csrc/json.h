// JSON for the diagnostics strings handed to Python (which parses them with json.loads): nlohmann::json, the library
// the cuDNN frontend ships and includes itself, so it is on the include path of every build.
#pragma once

#include <cudnn_frontend/thirdparty/nlohmann/json.hpp>

namespace convbias {

using Json = nlohmann::json;

} // namespace convbias
