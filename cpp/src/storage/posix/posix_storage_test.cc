// Posix-specific cases; the common behaviour is in storage_conformance_test.cc.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "base/test_util.h"
#include "nebulite/storage.h"

namespace nebulite {
namespace {

class PosixStorageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/nebulite-posix-XXXXXX";
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override {
    if (!mounted_.empty()) ::umount2(mounted_.c_str(), MNT_DETACH);
    ::chmod(dir_.c_str(), 0755);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // Mounts a small tmpfs at `path` (root only, and only where mounts are allowed).
  bool MountTmpfs(const std::string& path, unsigned long flags, const char* options) {
    ::mkdir(path.c_str(), 0755);
    if (::mount("tmpfs", path.c_str(), "tmpfs", flags, options) != 0) return false;
    mounted_ = path;
    return true;
  }

  std::string dir_;
  std::string mounted_;
};

TEST_F(PosixStorageTest, CreatesMissingRoot) {
  auto s = OpenPosixStorage(dir_ + "/a/b/c");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  struct stat st;
  ASSERT_EQ(::stat((dir_ + "/a/b/c").c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ((*s)->Describe(), "posix:" + dir_ + "/a/b/c");
  // The writability probe leaves nothing behind.
  auto names = (*s)->List("");
  ASSERT_TRUE(names.ok());
  EXPECT_TRUE(names->empty());
}

TEST_F(PosixStorageTest, RootUnderARegularFileFails) {
  std::ofstream(dir_ + "/file") << "x";
  auto s = OpenPosixStorage(dir_ + "/file/sub");
  EXPECT_FALSE(s.ok());
  auto f = OpenPosixStorage(dir_ + "/file");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("not a directory"), std::string::npos)
      << f.status().ToString();
  EXPECT_EQ(OpenPosixStorage("").status().code(), StatusCode::kInvalidArgument);
}

TEST_F(PosixStorageTest, UnwritableRootIsPermissionDenied) {
  if (::geteuid() == 0) {
    // Root ignores permission bits; a read-only mount is what it cannot write.
    if (!MountTmpfs(dir_ + "/ro", MS_RDONLY, "size=64k")) {
      GTEST_SKIP() << "running as root and cannot mount a read-only tmpfs: "
                   << std::strerror(errno);
    }
    auto s = OpenPosixStorage(dir_ + "/ro");
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), StatusCode::kPermissionDenied) << s.status().ToString();
    EXPECT_NE(s.status().message().find("not writable"), std::string::npos);
    return;
  }
  ASSERT_EQ(::mkdir((dir_ + "/locked").c_str(), 0555), 0);
  auto s = OpenPosixStorage(dir_ + "/locked");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kPermissionDenied) << s.status().ToString();
  // A missing root below an unwritable directory cannot be created.
  auto sub = OpenPosixStorage(dir_ + "/locked/sub");
  ASSERT_FALSE(sub.ok());
  EXPECT_EQ(sub.status().code(), StatusCode::kPermissionDenied) << sub.status().ToString();
}

TEST_F(PosixStorageTest, OnlyRegularFilesAreData) {
  // A device or a FIFO where a file is expected is refused without blocking on it.
  auto s = OpenPosixStorage(dir_ + "/root");
  ASSERT_TRUE(s.ok());
  if (::access("/dev/full", W_OK) == 0) {
    ASSERT_EQ(::symlink("/dev/full", (dir_ + "/root/full").c_str()), 0);
    EXPECT_EQ((*s)->NewWritableFile("full", 0).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ((*s)->AppendToFile("full", "x").code(), StatusCode::kInvalidArgument);
  }
  ASSERT_EQ(::mkfifo((dir_ + "/root/fifo").c_str(), 0644), 0);
  EXPECT_EQ((*s)->ReadFile("fifo", 100).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*s)->NewReadableFile("fifo").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*s)->NewWritableFile("fifo", 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Val((*s)->Stat("fifo")).type, FileType::kOther);
  ASSERT_EQ(::mkfifo((dir_ + "/root/lockfifo").c_str(), 0644), 0);
  EXPECT_EQ((*s)->TryLock("lockfifo", false).status().code(), StatusCode::kInvalidArgument);
}

mode_t ModeOf(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return 07777;
  return st.st_mode & 07777;
}

// Restores the umask a test changed.
class UmaskScope {
 public:
  explicit UmaskScope(mode_t mask) : old_(::umask(mask)) {}
  ~UmaskScope() { ::umask(old_); }

 private:
  mode_t old_;
};

TEST_F(PosixStorageTest, FilesFollowTheUmaskByDefault) {
  UmaskScope mask(002);
  auto s = OpenPosixStorage(dir_ + "/store", false);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE((*s)->WriteFileAtomic("t/atomic", "x").ok());
  ASSERT_TRUE((*s)->AppendToFile("t/appended", "x\n").ok());
  auto w = (*s)->NewWritableFile("t/written", 0);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Close().ok());
  for (const char* f : {"/store/t/atomic", "/store/t/appended", "/store/t/written"})
    EXPECT_EQ(ModeOf(dir_ + f), 0664u) << f;
  EXPECT_EQ(ModeOf(dir_ + "/store/t"), 0775u);
}

TEST_F(PosixStorageTest, AnExplicitFileModeHoldsWhateverTheUmask) {
  UmaskScope mask(077);
  PosixOptions options;
  options.direct_io = false;
  options.file_mode = 0640;
  auto s = OpenPosixStorage(dir_ + "/store", options);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE((*s)->WriteFileAtomic("t/v/atomic", "x").ok());
  ASSERT_TRUE((*s)->CreateFileExclusive("t/v/exclusive", "x").ok());
  ASSERT_TRUE((*s)->AppendToFile("t/appended", "x\n").ok());
  auto w = (*s)->NewWritableFile("t/v/written", 0);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Close().ok());
  for (const char* f :
       {"/store/t/v/atomic", "/store/t/v/exclusive", "/store/t/appended", "/store/t/v/written"})
    EXPECT_EQ(ModeOf(dir_ + f), 0640u) << f;
  // Directories: search wherever the mode grants read.
  EXPECT_EQ(ModeOf(dir_ + "/store/t"), 0750u);
  EXPECT_EQ(ModeOf(dir_ + "/store/t/v"), 0750u);
}

TEST_F(PosixStorageTest, AFileModeMustLetTheOwnerReadAndWrite) {
  for (uint32_t bad : {0400u, 0200u, 01777u, 04644u, 0100000u}) {
    PosixOptions options;
    options.file_mode = bad;
    EXPECT_EQ(OpenPosixStorage(dir_ + "/store", options).status().code(),
              StatusCode::kInvalidArgument)
        << std::oct << bad;
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/store"));  // refused before creating anything
}

TEST_F(PosixStorageTest, DeletingUnderAFileDeletesNothing) {
  auto s = OpenPosixStorage(dir_ + "/store", false);
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE((*s)->WriteFileAtomic("t", "not a directory").ok());
  // A file stands where the directory would be: nothing of that name exists, nothing fails.
  EXPECT_TRUE((*s)->DeleteRecursively("t/v").ok());
  EXPECT_TRUE((*s)->Delete("t/v/f").ok());
  EXPECT_EQ(Val((*s)->ReadFile("t", 100)), "not a directory");
}

TEST_F(PosixStorageTest, ReadOnlyStoreWritesNothing) {
  ASSERT_EQ(::mkdir((dir_ + "/ro").c_str(), 0755), 0);
  {
    auto rw = OpenPosixStorage(dir_ + "/ro");
    ASSERT_TRUE(rw.ok());
    ASSERT_TRUE((*rw)->WriteFileAtomic("t/f", "data").ok());
  }
  auto s = OpenPosixStorage(dir_ + "/ro", PosixOptions{true, /*read_only=*/true});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_TRUE((*s)->read_only());
  EXPECT_EQ(Val((*s)->ReadFile("t/f", 100)), "data");
  EXPECT_EQ((*s)->WriteFileAtomic("t/g", "x").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ((*s)->NewWritableFile("t/g", 0).status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ((*s)->CreateDirs("u").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ((*s)->Delete("t/f").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ((*s)->DeleteRecursively("t").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ((*s)->AppendToFile("t/f", "x").code(), StatusCode::kPermissionDenied);
  // Nothing was created: no probe, no directory.
  EXPECT_EQ(Val((*s)->List("")), (std::vector<std::string>{"t"}));
  // A missing root is NotFound, never created.
  auto missing = OpenPosixStorage(dir_ + "/nope", PosixOptions{true, true});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/nope"));
}

TEST_F(PosixStorageTest, FullFilesystemIsNoSpace) {
  if (!MountTmpfs(dir_ + "/small", 0, "size=256k")) {
    GTEST_SKIP() << "cannot mount a small tmpfs here (needs root and mount rights): "
                 << std::strerror(errno);
  }
  auto s = OpenPosixStorage(dir_ + "/small");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  // tmpfs refuses O_DIRECT (EINVAL): the driver silently uses buffered writes.
  auto f = (*s)->NewWritableFile("t/v/rank0/big", 0);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  std::string chunk(64 * 1024, 'x');
  Status st;
  for (uint64_t off = 0; st.ok() && off < (4u << 20); off += chunk.size()) {
    st = (*f)->WriteAt(off, chunk.data(), chunk.size());
  }
  EXPECT_EQ(st.code(), StatusCode::kNoSpace) << st.ToString();
  (void)(*f)->Close();
  Status atomic = (*s)->WriteFileAtomic("t/v/COMMITTED", std::string(1 << 20, 'm'));
  EXPECT_EQ(atomic.code(), StatusCode::kNoSpace) << atomic.ToString();
  // The failed atomic write leaves neither the target nor a temporary file.
  auto names = (*s)->List("t/v");
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, (std::vector<std::string>{"rank0"}));
}

TEST_F(PosixStorageTest, DirectIoWritesLandOnDisk) {
  // Whatever the filesystem under TMPDIR, aligned writes must read back intact.
  auto s = OpenPosixStorage(dir_ + "/d", /*use_direct_io=*/true);
  ASSERT_TRUE(s.ok());
  void* p = nullptr;
  ASSERT_EQ(::posix_memalign(&p, 4096, 3 * 4096), 0);
  std::memset(p, 'z', 3 * 4096);
  auto f = (*s)->NewWritableFile("f", 3 * 4096 + 3);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->WriteAt(0, p, 3 * 4096).ok());
  ASSERT_TRUE((*f)->WriteAt(3 * 4096, "end", 3).ok());
  ASSERT_TRUE((*f)->Sync().ok());
  ASSERT_TRUE((*f)->Close().ok());
  std::free(p);
  auto text = (*s)->ReadFile("f", 1 << 20);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, std::string(3 * 4096, 'z') + "end");
}

TEST_F(PosixStorageTest, DeleteRecursivelyDoesNotFollowSymlinks) {
  auto s = OpenPosixStorage(dir_ + "/root");
  ASSERT_TRUE(s.ok());
  std::filesystem::create_directories(dir_ + "/outside");
  std::ofstream(dir_ + "/outside/precious") << "keep";
  ASSERT_TRUE((*s)->CreateDirs("t/v").ok());
  ASSERT_EQ(::symlink((dir_ + "/outside").c_str(), (dir_ + "/root/t/v/link").c_str()), 0);
  ASSERT_TRUE((*s)->DeleteRecursively("t").ok());
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/outside/precious"));
}

// A lock file readable by others would let another user take a shared lock on it (and
// so keep a dead run's leftovers from ever being removed): lock files are the owner's.
TEST_F(PosixStorageTest, LockFilesAreCreatedForTheOwnerOnly) {
  auto s = OpenPosixStorage(dir_ + "/root");
  ASSERT_TRUE(s.ok());
  const mode_t old = ::umask(0);
  auto lock = (*s)->TryLock("locks/run", /*exclusive=*/false);
  ::umask(old);
  ASSERT_TRUE(lock.ok()) << lock.status().ToString();
  ASSERT_NE(*lock, nullptr);
  struct stat st;
  ASSERT_EQ(::stat((dir_ + "/root/locks/run").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_F(PosixStorageTest, DeletionsNeverGoThroughASymlink) {
  // A tag directory that is a link out of the store: retention and dead-run clean-up
  // must not delete what it leads to, nor the link itself.
  auto s = OpenPosixStorage(dir_ + "/root");
  ASSERT_TRUE(s.ok());
  std::filesystem::create_directories(dir_ + "/outside/vdead-000001");
  std::ofstream(dir_ + "/outside/vdead-000001/COMMITTED") << "keep";
  ASSERT_EQ(::symlink((dir_ + "/outside").c_str(), (dir_ + "/root/linked").c_str()), 0);
  EXPECT_EQ((*s)->Delete("linked/vdead-000001/COMMITTED").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*s)->DeleteRecursively("linked/vdead-000001").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*s)->DeleteRecursively("linked").code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE((*s)->RemoveDirIfEmpty("linked/vdead-000001").ok());
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/outside/vdead-000001/COMMITTED"));
  EXPECT_TRUE(std::filesystem::is_symlink(dir_ + "/root/linked"));
  // Paths without links are deleted as before.
  ASSERT_TRUE((*s)->WriteFileAtomic("t/v/f", "x").ok());
  EXPECT_TRUE((*s)->Delete("t/v/f").ok());
  EXPECT_TRUE((*s)->DeleteRecursively("t").ok());
}

TEST_F(PosixStorageTest, PrivateFilesAreOwnerOnly) {
  auto s = OpenPosixStorage(dir_ + "/root");
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE((*s)->WritePrivateFileAtomic(".nebulite/lease", "x").ok());
  struct stat st;
  ASSERT_EQ(::stat((dir_ + "/root/.nebulite/lease").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(Val((*s)->ReadFile(".nebulite/lease", 16)), "x");
}

}  // namespace
}  // namespace nebulite
