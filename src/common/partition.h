// common/partition.h: whether the ranks' vocabulary ranges tile [0, V), and where not. The
// one-call forward checks the gathered headers with it, the staged merge the shards it is
// given; each words the failure its own way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace vpce::detail {

struct OwnedRange {
  int64_t begin;
  int64_t end;
  int rank;
};

// The first place where the ranges fail to tile [0, vocab_size), in column order: a gap
// (columns [covered, begin) owned by no rank; `first` is the range after it, or none at the
// end) or an overlap (`previous` and `first`).
struct PartitionFault {
  enum class Kind { kGap, kOverlap } kind;
  int64_t covered;                     // the columns below it are tiled
  std::optional<OwnedRange> previous;  // (an overlap: the range before)
  std::optional<OwnedRange> first;     // the range at the fault, none for a gap at the end
};

// Empty ranges own nothing and may sit anywhere.
inline std::optional<PartitionFault> partition_fault(std::vector<OwnedRange> ranges, int64_t vocab_size) {
  std::erase_if(ranges, [](const OwnedRange& r) { return r.begin == r.end; });
  std::stable_sort(ranges.begin(), ranges.end(), [](const OwnedRange& a, const OwnedRange& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  int64_t covered = 0;
  std::optional<OwnedRange> previous;
  for (const OwnedRange& r : ranges) {
    if (r.begin > covered) return PartitionFault{PartitionFault::Kind::kGap, covered, previous, r};
    if (r.begin < covered) return PartitionFault{PartitionFault::Kind::kOverlap, covered, previous, r};
    covered = r.end;
    previous = r;
  }
  if (covered != vocab_size) return PartitionFault{PartitionFault::Kind::kGap, covered, previous, std::nullopt};
  return std::nullopt;
}

}  // namespace vpce::detail
