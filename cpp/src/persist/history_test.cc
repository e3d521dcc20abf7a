#include "persist/history.h"

#include <gtest/gtest.h>

#include "base/test_util.h"

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
  std::string csv = Val(store->ReadFile(kHistoryFile, 1 << 20));
  EXPECT_NE(csv.find("\n2026-12-01T06:14:28.374Z,t,v,model,0,1000,"), std::string::npos) << csv;
}

}  // namespace
}  // namespace nebulite
