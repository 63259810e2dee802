// The decision both plan kinds (forward: fprop.cpp, weight gradient: wgrad.cpp) make for a problem whose input channel
// rows are misaligned: keep the plan of the problem as it is, or run the plan of the problem on zero-padded copies
// (pad_channels.h). One rule for both: TORCH_CONVBIAS_PAD_CHANNELS=on takes the padded way wherever its plan runs a
// graph, off never tries it, auto measures both complete ways (copies included) when choices are timed and keeps the
// faster; untimed choices keep the problem as it is (heuristics cannot weigh the copies). The guard around it,
// optional_way_or_own, serves the regrouped way of space_to_depth.h as well.
#pragma once

#include <functional>
#include <memory>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>

#include "cuda/knobs.h"
#include "cuda/math_flags.h"
#include "cuda/pad_channels.h"

namespace convbias::cuda {

// Whether the padded way is tried at all for a problem with `padded` (> 0) channels instead of `channels`, given the
// plan as it is was made for want of memory (`own_transient`: not a final choice, nothing to compare against).
inline bool padded_way_tried(int64_t padded, const MathFlags& flags, bool own_transient) {
  const std::string& knob = knobs().pad_channels;
  return padded > 0 && knob != "off" && (knob == "on" || (current_tuning(flags) != Tuning::Untimed && !own_transient));
}

// "input channels zero-padded from 3 to 8 (16-byte rows)": the note a plan carries about the padded way.
inline std::string padded_way_note(int64_t channels, int64_t padded) {
  std::ostringstream note;
  note << "input channels zero-padded from " << channels << " to " << padded << " (16-byte rows)";
  return note.str();
}

// `own`, or a copy of `padded` (whose plan runs a graph) marked as run on the padded copies, as the knob says or as
// measured: time_own / time_padded run each complete way (called only when measuring); `record(plan, own_ms,
// padded_ms)` stores the two times in the plan kept. Plan has notes and via_padded_channels.
template <typename Plan>
std::shared_ptr<const Plan> keep_padded_or_own(
    std::shared_ptr<Plan> own, const std::shared_ptr<const Plan>& padded, const std::string& note,
    const std::function<float()>& time_own, const std::function<float()>& time_padded,
    const std::function<void(Plan&, float, float)>& record) {
  const auto via_padded = [&](const std::string& why) {
    auto plan = std::make_shared<Plan>(*padded);
    plan->via_padded_channels = padded;
    plan->notes.push_back(note + why);
    return plan;
  };
  if (knobs().pad_channels == "on") {
    return via_padded(" (TORCH_CONVBIAS_PAD_CHANNELS=on)");
  }
  const float own_ms = time_own();
  const float padded_ms = time_padded();
  std::ostringstream measured;
  measured << padded_ms << " ms against " << own_ms << " ms as it is";
  if (padded_ms < own_ms) {
    auto plan = via_padded(": measured faster, " + measured.str());
    record(*plan, own_ms, padded_ms);
    return plan;
  }
  own->notes.push_back(note + " measured slower: " + measured.str());
  record(*own, own_ms, padded_ms);
  return own;
}

// `choose()` for a way of running a problem on copies made for it (the padded copies here, space_to_depth.h's regrouped
// ones), guarded: the way is optional, so whatever stops it leaves the problem its own way, `own`, with the reason in
// its notes, rather than failing a call that `own` runs. Out of memory for the `copies` (or the other problem's
// workspace) the choice is not final: `own` is marked transient (neither cached nor stored), to be made again when
// memory allows. Anything else (e.g. a forced TORCH_CONVBIAS_* path the other problem cannot take) is final for the key.
template <typename Plan>
std::shared_ptr<const Plan> optional_way_or_own(
    std::shared_ptr<Plan> own, const std::string& note, const std::string& copies,
    const std::function<std::shared_ptr<const Plan>()>& choose) {
  try {
    return choose();
  } catch (const c10::OutOfMemoryError&) {
    own->transient = true;
    own->notes.push_back(note + " not tried: out of memory for the " + copies);
  } catch (const c10::Error& error) {
    const std::string what = error.what_without_backtrace();
    own->notes.push_back(note + " failed, the problem runs as it is: " + what.substr(0, what.find('\n')));
  }
  return own;
}

// The padded way through optional_way_or_own: `choose()` is the padded problem's plan, then keep_padded_or_own.
template <typename Plan>
std::shared_ptr<const Plan> padded_or_own(
    std::shared_ptr<Plan> own, const std::string& note, const std::function<std::shared_ptr<const Plan>()>& choose) {
  return optional_way_or_own<Plan>(std::move(own), note, "padded copies", [&] {
    throw_injected_padded_way_failure();
    return choose();
  });
}

} // namespace convbias::cuda
