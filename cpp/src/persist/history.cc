#include "persist/history.h"

#include <chrono>
#include <cstdio>
#include <ctime>

namespace nebulite {
namespace {

std::string CsvField(const std::string& s) {
  bool quote = s.find_first_of(",\"\n\r") != std::string::npos;
  if (!quote) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

}  // namespace

std::string FormatUtc(int64_t unix_ns) {
  const std::time_t t = static_cast<std::time_t>(unix_ns / 1000000000);
  const int ms = static_cast<int>(unix_ns / 1000000 % 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
  return buf;
}

const char* HistoryLog::Header() {
  return "time_utc,tag,version,name,rank,bytes,blocking_seconds,persist_seconds,throughput_mb_s,"
         "tier,outcome\n";
}

std::string HistoryLog::FormatRow(const HistoryRow& r) {
  double secs = r.persist_seconds > 0 ? r.persist_seconds : r.blocking_seconds;
  double mbps = secs > 0 ? static_cast<double>(r.bytes) / secs / 1e6 : 0.0;
  char nums[160];
  std::snprintf(nums, sizeof(nums), "%u,%llu,%.6f,%.6f,%.1f", r.rank,
                static_cast<unsigned long long>(r.bytes), r.blocking_seconds, r.persist_seconds,
                mbps);
  return FormatUtc(r.time_unix_ns) + "," + CsvField(r.tag) + "," + CsvField(r.version) + "," +
         CsvField(r.name) + "," + nums + "," + CsvField(r.tier) + "," + CsvField(r.outcome) + "\n";
}

void HistoryLog::Append(HistoryRow row) {
  if (row.time_unix_ns == 0) {
    row.time_unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  }
  std::lock_guard<std::mutex> lock(mu_);
  rows_.push_back(row);
  if (rows_.size() > kHistoryRowsKept) rows_.pop_front();
  if (!storage_ || storage_->read_only()) return;
  unwritten_ += FormatRow(row);
}

void HistoryLog::Flush() {
  std::lock_guard<std::mutex> lock(mu_);
  WriteLocked();
}

void HistoryLog::WriteLocked() {
  if (unwritten_.empty()) return;
  std::string rows;
  rows.swap(unwritten_);  // written or dropped
  if (!header_written_) {
    // The first writer of the store creates the file, with its header and its rows.
    Result<bool> exists = storage_->FileExists(kHistoryFile);
    if (!exists.ok()) return;
    if (!*exists) {
      Status st = storage_->CreateFileExclusive(kHistoryFile, Header() + rows);
      if (st.ok()) {
        header_written_ = true;
        return;
      }
      if (st.code() != StatusCode::kAlreadyExists) return;
    }
    header_written_ = true;
  }
  (void)storage_->AppendToFile(kHistoryFile, rows);
}

std::vector<HistoryRow> HistoryLog::Rows() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::vector<HistoryRow>(rows_.begin(), rows_.end());
}

}  // namespace nebulite
