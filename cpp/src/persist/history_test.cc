#include "persist/history.h"

#include <gtest/gtest.h>

#include "base/test_util.h"
#include "nebulite/object_store.h"

namespace nebulite {
namespace {

// Each row keeps the time it was appended, and the CSV line shows that same time.
TEST(HistoryTest, RowsKeepTheTimeTheyWereAppended) {
  auto store = std::shared_ptr<Storage>(NewMemoryStorage());
  HistoryLog log(store);
  HistoryRow row{"t", "v", "model", 0, 1000, 0.5, 0.25, "persistent", "persisted"};
  row.time_unix_ns = 1796105668374000000;  // 2026-12-01T06:14:28.374Z
  log.Append(row);
  log.Append({"t", "v", "", 0, 1000, 0, 0.5, "persistent", "committed"});
  std::vector<HistoryRow> rows = log.Rows();
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].time_unix_ns, 1796105668374000000);
  EXPECT_GE(rows[1].time_unix_ns, rows[0].time_unix_ns);  // set by Append when not given
  EXPECT_EQ(FormatUtc(rows[0].time_unix_ns), "2026-12-01T06:14:28.374Z");
  log.Flush();
  std::string csv = Val(store->ReadFile(kHistoryFile, 1 << 20));
  EXPECT_NE(csv.find("\n2026-12-01T06:14:28.374Z,t,v,model,0,1000,"), std::string::npos) << csv;
}


// The rows wait for Flush() (which the engine's background threads call, so that no
// caller waits for the store) and go in one write, the first one creating the file with its
// header: on an object store an append rewrites the object.
TEST(HistoryTest, RowsWaitForFlushAndGoInOneWrite) {
  for (bool object_store : {false, true}) {
    SCOPED_TRACE(object_store ? "object store" : "posix-like store");
    auto store = object_store
                     ? std::shared_ptr<Storage>(OpenObjectStorage(NewMemoryObjectClient()))
                     : std::shared_ptr<Storage>(NewMemoryStorage());
    HistoryLog log(store);
    log.Append({"t", "v", "model", 0, 1000, 0.5, 0.25, "persistent", "persisted"});
    log.Append({"t", "v", "", 0, 1000, 0, 0.5, "persistent", "committed"});
    EXPECT_EQ(Val(store->FileExists(kHistoryFile)), false);
    EXPECT_EQ(log.Rows().size(), 2u);  // in memory at once
    log.Flush();
    std::string csv = Val(store->ReadFile(kHistoryFile, 1 << 20));
    EXPECT_EQ(csv.rfind(HistoryLog::Header(), 0), 0u) << csv;
    EXPECT_NE(csv.find(",t,v,model,0,1000,"), std::string::npos) << csv;
    EXPECT_NE(csv.find(",committed\n"), std::string::npos) << csv;
    log.Append({"u", "v", "", 0, 0, 0, 0, "persistent", "committed"});
    log.Flush();
    csv = Val(store->ReadFile(kHistoryFile, 1 << 20));
    EXPECT_NE(csv.find(",u,v,"), std::string::npos) << csv;
    EXPECT_EQ(csv.find(HistoryLog::Header(), 1), std::string::npos) << csv;  // one header
  }
}

}  // namespace
}  // namespace nebulite
