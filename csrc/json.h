// A minimal JSON writer for the diagnostics strings handed to Python (which parses them with json.loads).
#pragma once

#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace convbias {

inline std::string json_string(const std::string& s) {
  std::ostringstream out;
  out << '"';
  for (const char ch : s) {
    switch (ch) {
      case '"': out << "\\\""; break;
      case '\\': out << "\\\\"; break;
      case '\n': out << "\\n"; break;
      case '\t': out << "\\t"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          out << "\\u00" << "0123456789abcdef"[(ch >> 4) & 0xf] << "0123456789abcdef"[ch & 0xf];
        } else {
          out << ch;
        }
    }
  }
  out << '"';
  return out.str();
}

// Builds {"key": value, ...}; values given already encoded (numbers, json_string(), nested objects).
class JsonObject {
 public:
  JsonObject& raw(const std::string& key, const std::string& encoded) {
    fields_.emplace_back(key, encoded);
    return *this;
  }
  JsonObject& str(const std::string& key, const std::string& value) { return raw(key, json_string(value)); }
  JsonObject& boolean(const std::string& key, bool value) { return raw(key, value ? "true" : "false"); }
  template <typename Number>
  JsonObject& num(const std::string& key, Number value) {
    std::ostringstream out;
    out << value;
    return raw(key, out.str());
  }
  JsonObject& strings(const std::string& key, const std::vector<std::string>& values) {
    std::string encoded = "[";
    for (size_t i = 0; i < values.size(); ++i) {
      encoded += (i ? ", " : "") + json_string(values[i]);
    }
    return raw(key, encoded + "]");
  }
  std::string dump() const {
    std::string out = "{";
    for (size_t i = 0; i < fields_.size(); ++i) {
      out += (i ? ", " : "") + json_string(fields_[i].first) + ": " + fields_[i].second;
    }
    return out + "}";
  }

 private:
  std::vector<std::pair<std::string, std::string>> fields_;
};

} // namespace convbias
