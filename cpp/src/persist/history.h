// HistoryLog: appends checkpointHistories.csv rows to a store and keeps the newest rows
// in memory for History(). Rows are held until Flush(), which the engine's background
// threads call once a version is committed (in the store, or in memory only), has failed,
// and when the engine closes: the rows of one commit are one write (one append on a posix
// store; on an object store an append rewrites the whole object, three requests).
// Columns (stable; documented in docs/format.md): time_utc, tag, version, name, rank,
// bytes, blocking_seconds, persist_seconds, throughput_mb_s, tier, outcome.
// The history is best effort: a row that cannot be written is dropped from the file
// (never from memory) and never fails a checkpoint.
// Thread-safety: every method is thread-safe.
#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "nebulite/commit.h"  // kHistoryFile
#include "nebulite/engine.h"
#include "nebulite/storage.h"

namespace nebulite {

inline constexpr size_t kHistoryRowsKept = 10000;  // in memory; the file keeps them all

// A wall-clock time as the CSV's time_utc column writes it: 2026-12-01T06:14:28.374Z.
std::string FormatUtc(int64_t unix_ns);

class HistoryLog {
 public:
  // `storage` receives the CSV (nullptr: rows are kept in memory only).
  explicit HistoryLog(std::shared_ptr<Storage> storage) : storage_(std::move(storage)) {}
  // Adds `row`, with the current time unless it has one.
  void Append(HistoryRow row);
  // Writes the rows held back (object stores), in one write.
  void Flush();
  std::vector<HistoryRow> Rows();
  static std::string FormatRow(const HistoryRow& row);
  static const char* Header();

 private:
  std::shared_ptr<Storage> storage_;
  std::mutex mu_;
  void WriteLocked();

  bool header_written_ = false;  // GUARDED_BY(mu_)
  std::string unwritten_;        // GUARDED_BY(mu_): formatted rows not in the file yet
  std::deque<HistoryRow> rows_;  // GUARDED_BY(mu_)
};

}  // namespace nebulite
