// HistoryLog: appends checkpointHistories.csv rows to a store, one write per row.
// Columns (stable; documented in docs/format.md): time_utc, tag, version, name, rank,
// bytes, blocking_seconds, persist_seconds, throughput_mb_s, tier, outcome.
// Thread-safety: Append() is thread-safe.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "nebulite/engine.h"

namespace nebulite {

inline constexpr const char* kHistoryFile = "checkpointHistories.csv";

class HistoryLog {
 public:
  // `root` is the posix directory for the CSV; empty keeps rows in memory only.
  explicit HistoryLog(std::string root) : root_(std::move(root)) {}
  void Append(const HistoryRow& row);
  std::vector<HistoryRow> Rows();
  static std::string FormatRow(const HistoryRow& row);
  static const char* Header();

 private:
  std::string root_;
  std::mutex mu_;
  std::vector<HistoryRow> rows_;  // GUARDED_BY(mu_)
};

}  // namespace nebulite
