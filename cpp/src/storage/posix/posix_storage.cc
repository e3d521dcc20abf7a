// The posix storage driver: local disks, NFS, Lustre and FUSE mounts (blobfuse).
//
// Atomic write protocol (WriteFileAtomic), the basis of manifests and commit markers:
//   1. Write the data to a temporary file with a unique name in the target's directory,
//      ".<name>.tmp.<pid>.<counter>" (O_CREAT | O_EXCL), so concurrent writers and
//      other processes never collide and the rename below never crosses filesystems.
//   2. fsync() the temporary file: its bytes are durable before it gets a real name.
//   3. rename() it over the target: readers see the old file or the new one, never a mix.
//   4. fsync() the directory: the rename itself is durable when the call returns.
// On any failure before step 3 the temporary file is unlinked; the target is untouched.
//
// CreateFileExclusive is the same protocol with link() instead of rename() in step 3:
// link() fails with EEXIST when the target exists, atomically, also on NFS.
//
// Data files (NewWritableFile): the file is opened with O_CREAT | O_TRUNC. When direct
// I/O is enabled a second descriptor is opened with O_DIRECT and serves the WriteAt()
// calls whose buffer, offset and length are all 4 KiB aligned (the bulk of a tensor
// payload); everything else (the unaligned tail) goes through the buffered descriptor.
// Both touch disjoint pages because callers write disjoint ranges. A filesystem that
// refuses O_DIRECT (tmpfs, some FUSE mounts: EINVAL) silently gets buffered I/O only.
// Sync() is fdatasync() of both descriptors. No preallocation: the final size is exactly
// the end of the furthest write.
//
// Reading: files are opened with O_NONBLOCK and checked to be regular files before any
// read, so a FIFO or a device at a data file's path never blocks a reader. A
// ReadableFile keeps its descriptor: a file deleted or renamed over while it is read
// stays readable to the end.
//
// Locks are flock(2) on a file under the root. On NFS they are shared by every client;
// on Lustre with localflock and on some FUSE mounts they are node-local.
//
// Read-only stores (PosixOptions::read_only) create, probe and write nothing: every
// change returns PermissionDenied, so a reader works on a mount it cannot write.
//
// Directories: missing parents are created with mkdir, and each directory this driver
// creates is made durable at once by fsyncing its parent. Entries created inside a
// directory (files, renames, deletions) are durable only after SyncDir() of it, per the
// contract in storage.h; the commit protocol does that.
//
// Thread-safety: the driver holds no mutable state besides an atomic counter; every
// method may run concurrently. A PosixWritableFile accepts concurrent WriteAt() calls
// for disjoint ranges (pwrite is positional).
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "nebulite/storage.h"
#include "storage/path_internal.h"

namespace nebulite {
namespace {

constexpr uint64_t kDirectIoAlignment = 4096;

std::atomic<uint64_t> g_temp_counter{0};

// Closes a descriptor on scope exit.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  // Closes now and reports the result (NFS reports deferred write errors at close).
  int CloseNow() {
    int fd = fd_;
    fd_ = -1;
    return fd >= 0 ? ::close(fd) : 0;
  }

 private:
  int fd_;
};

Status ErrnoStatus(int err, const std::string& what, const std::string& path) {
  return Status::FromErrno(err, what + " '" + path + "'");
}

// pwrite() until all n bytes are written, retrying partial writes and EINTR.
// Returns 0 or an errno value.
int PwriteFully(int fd, const char* data, size_t n, uint64_t offset) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, data, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (w == 0) return EIO;  // no progress: treat as an I/O error rather than spin
    data += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return 0;
}

int FsyncDirectory(const std::string& full_dir) {
  int fd = ::open(full_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  int rc = ::fsync(fd);
  int err = rc < 0 ? errno : 0;
  ::close(fd);
  // Some filesystems (a few FUSE mounts) cannot fsync a directory; the rename is then
  // as durable as they can make it.
  if (err == EINVAL) err = 0;
  return err;
}

std::string ParentOfFull(const std::string& full) {
  size_t pos = full.rfind('/');
  if (pos == std::string::npos) return ".";
  if (pos == 0) return "/";
  return full.substr(0, pos);
}

// Modes of what a store creates (PosixOptions::file_mode); 0 leaves them to the umask.
struct CreateModes {
  explicit CreateModes(uint32_t file_mode) : file(file_mode) {
    if (file_mode != 0) dir = file_mode | ((file_mode & 0444) >> 2);  // x wherever r
  }
  mode_t open_file() const { return file != 0 ? file : 0666; }
  mode_t make_dir() const { return dir != 0 ? dir : 0777; }
  uint32_t file = 0;
  uint32_t dir = 0;
};

// An explicit mode holds whatever the umask: set it on what was just created.
int ApplyFileMode(int fd, const CreateModes& modes) {
  if (modes.file == 0) return 0;
  return ::fchmod(fd, modes.file) == 0 ? 0 : errno;
}

// mkdir -p of an absolute or relative OS path. Every directory created here is made
// durable by fsyncing its parent.
Status MakeDirsOnce(const std::string& full, const CreateModes& modes) {
  if (full.empty()) return Status::OK();
  struct stat st;
  if (::stat(full.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return Status::OK();
    return Status::FromErrno(ENOTDIR, "create directory '" + full + "'");
  }
  std::string parent = ParentOfFull(full);
  if (parent != full) NEBULITE_RETURN_IF_ERROR(MakeDirsOnce(parent, modes));
  if (::mkdir(full.c_str(), modes.make_dir()) != 0) {
    int err = errno;
    if (err == EEXIST && ::stat(full.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      return Status::OK();  // another writer created it concurrently
    }
    return ErrnoStatus(err, "create directory", full);
  }
  if (modes.dir != 0 && ::chmod(full.c_str(), modes.dir) != 0)
    return ErrnoStatus(errno, "set the mode of", full);
  int err = FsyncDirectory(parent);
  if (err != 0) return ErrnoStatus(err, "fsync directory", parent);
  return Status::OK();
}

// A parent may vanish between its creation and the child's (another process removing
// an empty tag directory with RemoveDirIfEmpty): start again from the top.
Status MakeDirs(const std::string& full, const CreateModes& modes) {
  for (int attempt = 0;; ++attempt) {
    Status st = MakeDirsOnce(full, modes);
    if (st.code() != StatusCode::kNotFound || attempt == 16) return st;
  }
}

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(std::string path, int buffered_fd, int direct_fd)
      : path_(std::move(path)), buffered_fd_(buffered_fd), direct_fd_(direct_fd) {}
  ~PosixWritableFile() override { (void)Close(); }

  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    if (closed_.load()) return Status::FailedPrecondition("write to closed file '" + path_ + "'");
    if (n == 0) return Status::OK();
    const char* p = static_cast<const char*>(data);
    if (direct_fd_ >= 0 && direct_ok_.load(std::memory_order_relaxed) && IsAligned(p, offset, n)) {
      int err = PwriteFully(direct_fd_, p, n, offset);
      if (err == 0) return Status::OK();
      // The filesystem accepted O_DIRECT at open but refuses the I/O: stop using it.
      if (err != EINVAL) return ErrnoStatus(err, "write", path_);
      direct_ok_.store(false);
    }
    int err = PwriteFully(buffered_fd_, p, n, offset);
    if (err != 0) return ErrnoStatus(err, "write", path_);
    return Status::OK();
  }

  Status Sync() override {
    if (closed_.load()) return Status::FailedPrecondition("sync of closed file '" + path_ + "'");
    if (direct_fd_ >= 0 && ::fdatasync(direct_fd_) != 0) {
      return ErrnoStatus(errno, "fdatasync", path_);
    }
    if (::fdatasync(buffered_fd_) != 0) return ErrnoStatus(errno, "fdatasync", path_);
    return Status::OK();
  }

  Status Close() override {
    if (closed_.exchange(true)) return Status::OK();
    Status result;
    if (direct_fd_ >= 0 && ::close(direct_fd_) != 0) result = ErrnoStatus(errno, "close", path_);
    if (::close(buffered_fd_) != 0 && result.ok()) result = ErrnoStatus(errno, "close", path_);
    return result;
  }

 private:
  static bool IsAligned(const char* p, uint64_t offset, size_t n) {
    return reinterpret_cast<uintptr_t>(p) % kDirectIoAlignment == 0 &&
           offset % kDirectIoAlignment == 0 && n % kDirectIoAlignment == 0;
  }

  const std::string path_;
  const int buffered_fd_;
  const int direct_fd_;  // -1 when direct I/O is off or unsupported
  std::atomic<bool> direct_ok_{true};
  std::atomic<bool> closed_{false};
};

class PosixReadableFile final : public ReadableFile {
 public:
  PosixReadableFile(std::string path, int fd, uint64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}
  ~PosixReadableFile() override { ::close(fd_); }

  uint64_t size() const override { return size_; }

  Result<size_t> ReadAt(uint64_t offset, size_t n, void* dst) override {
    size_t done = 0;
    char* out = static_cast<char*>(dst);
    while (done < n) {
      ssize_t r = ::pread(fd_, out + done, n - done, static_cast<off_t>(offset + done));
      if (r < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, "read", path_);
      }
      if (r == 0) break;  // end of file
      done += static_cast<size_t>(r);
    }
    return done;
  }

 private:
  const std::string path_;
  const int fd_;
  const uint64_t size_;
};

class PosixLock final : public StoreLock {
 public:
  explicit PosixLock(int fd) : fd_(fd) {}
  ~PosixLock() override { ::close(fd_); }  // closing the last descriptor drops the flock

 private:
  const int fd_;
};

// A FIFO without a reader (ENXIO) or a directory is not a file to write.
Status OpenForWriteError(int err, const char* what, const std::string& full) {
  if (err == ENXIO || err == ENODEV || err == EISDIR) {
    return Status::InvalidArgument("'" + full + "' is not a regular file");
  }
  return ErrnoStatus(err, what, full);
}

// Opens `full` for reading without blocking on a FIFO or a device, and only if it is a
// regular file. Returns the descriptor and the file's status.
Result<std::pair<int, struct stat>> OpenRegular(const std::string& full) {
  int fd = ::open(full.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    int err = errno;
    if (err == EISDIR) return Status::InvalidArgument("'" + full + "' is a directory");
    if (err == ENXIO || err == ENODEV) {
      return Status::InvalidArgument("'" + full + "' is not a regular file");
    }
    return ErrnoStatus(err, "open", full);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(err, "stat", full);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument("'" + full + "' is " +
                                   (S_ISDIR(st.st_mode) ? "a directory" : "not a regular file"));
  }
  return std::make_pair(fd, st);
}

class PosixStorage final : public Storage {
 public:
  PosixStorage(std::string root, PosixOptions options)
      : root_(std::move(root)), options_(options), modes_(options.file_mode) {}

  std::string Describe() const override { return "posix:" + root_; }
  bool read_only() const override { return options_.read_only; }

  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        uint64_t size) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    NEBULITE_RETURN_IF_ERROR(Writable());
    NEBULITE_RETURN_IF_ERROR(MakeDirs(Full(ParentDir(path)), modes_));
    std::string full = Full(path);
    int fd = ::open(full.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NONBLOCK,
                    modes_.open_file());
    if (fd < 0) return OpenForWriteError(errno, "create", full);
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return Status::InvalidArgument("'" + full + "' is not a regular file");
    }
    if (int err = ApplyFileMode(fd, modes_); err != 0) {
      ::close(fd);
      return ErrnoStatus(err, "set the mode of", full);
    }
    int direct_fd = -1;
    if (options_.direct_io) {
      direct_fd = ::open(full.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
      if (direct_fd < 0 && errno != EINVAL) {
        int err = errno;
        ::close(fd);
        return ErrnoStatus(err, "open (O_DIRECT)", full);
      }
    }
    return std::unique_ptr<WritableFile>(new PosixWritableFile(full, fd, direct_fd));
  }

  Status WriteFileAtomic(const std::string& path, const std::string& data) override {
    return WriteViaTemp(path, data, /*exclusive=*/false);
  }

  Status WritePrivateFileAtomic(const std::string& path, const std::string& data) override {
    return WriteViaTemp(path, data, /*exclusive=*/false, /*owner_only=*/true);
  }

  Status CreateFileExclusive(const std::string& path, const std::string& data) override {
    return WriteViaTemp(path, data, /*exclusive=*/true);
  }

  Status AppendToFile(const std::string& path, const std::string& data) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    NEBULITE_RETURN_IF_ERROR(Writable());
    NEBULITE_RETURN_IF_ERROR(MakeDirs(Full(ParentDir(path)), modes_));
    const std::string full = Full(path);
    int fd = ::open(full.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK,
                    modes_.open_file());
    if (fd < 0) return OpenForWriteError(errno, "open", full);
    FdCloser closer(fd);
    struct stat st;
    if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, "stat", full);
    if (!S_ISREG(st.st_mode))
      return Status::InvalidArgument("'" + full + "' is not a regular file");
    if (st.st_size == 0) {  // most likely created just now
      if (int err = ApplyFileMode(fd, modes_); err != 0 && err != EPERM)
        return ErrnoStatus(err, "set the mode of", full);
    }
    // One write() of the whole line: O_APPEND keeps concurrent appenders' lines whole.
    ssize_t w;
    do {
      w = ::write(fd, data.data(), data.size());
    } while (w < 0 && errno == EINTR);
    if (w < 0) return ErrnoStatus(errno, "append to", full);
    if (static_cast<size_t>(w) != data.size())
      return Status::IOError("short append to '" + full + "'");
    if (closer.CloseNow() != 0) return ErrnoStatus(errno, "close", full);
    return Status::OK();
  }

  Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    const std::string full = Full(path);
    NEBULITE_ASSIGN_OR_RETURN(auto opened, OpenRegular(full));
    return std::unique_ptr<ReadableFile>(
        new PosixReadableFile(full, opened.first, static_cast<uint64_t>(opened.second.st_size)));
  }

  Result<std::string> ReadFile(const std::string& path, uint64_t max_bytes) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    const std::string full = Full(path);
    NEBULITE_ASSIGN_OR_RETURN(auto opened, OpenRegular(full));
    const int fd = opened.first;
    FdCloser closer(fd);
    const struct stat& st = opened.second;
    auto too_big = [&] {
      return Status::Corruption("'" + full + "' is larger than the limit of " +
                                std::to_string(max_bytes) + " bytes");
    };
    if (static_cast<uint64_t>(st.st_size) > max_bytes) return too_big();
    // Read until end of file even if it grew since fstat, but never past the bound.
    std::string out;
    out.resize(static_cast<size_t>(st.st_size) + 1);
    size_t done = 0;
    while (true) {
      if (done == out.size()) {
        if (done > max_bytes) return too_big();
        const uint64_t limit = max_bytes < UINT64_MAX ? max_bytes + 1 : max_bytes;
        out.resize(static_cast<size_t>(std::min<uint64_t>(limit, out.size() * 2)));
      }
      ssize_t r = ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(done));
      if (r < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, "read", full);
      }
      if (r == 0) break;
      done += static_cast<size_t>(r);
    }
    if (done > max_bytes) return too_big();
    out.resize(done);
    return out;
  }

  Result<FileInfo> Stat(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "path", true));
    const std::string full = Full(path);
    struct stat st;
    if (::stat(full.c_str(), &st) != 0) {
      if (errno == ENOTDIR) return Status::NotFound("'" + full + "' does not exist");
      return ErrnoStatus(errno, "stat", full);
    }
    FileInfo info;
    info.type = S_ISREG(st.st_mode)   ? FileType::kFile
                : S_ISDIR(st.st_mode) ? FileType::kDirectory
                                      : FileType::kOther;
    info.size = static_cast<uint64_t>(st.st_size);
    info.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    return info;
  }

  Result<bool> Exists(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "path", true));
    const std::string full = Full(path);
    struct stat st;
    if (::stat(full.c_str(), &st) == 0) return true;
    if (errno == ENOENT || errno == ENOTDIR) return false;
    return ErrnoStatus(errno, "stat", full);
  }

  Result<std::vector<std::string>> List(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", true));
    const std::string full = Full(dir);
    std::vector<std::string> names;
    DIR* d = ::opendir(full.c_str());
    if (d == nullptr) {
      // A missing directory, or a file, has no entries.
      if (errno == ENOENT || errno == ENOTDIR) return names;
      return ErrnoStatus(errno, "list", full);
    }
    while (true) {
      errno = 0;
      struct dirent* e = ::readdir(d);
      if (e == nullptr) {
        int err = errno;
        ::closedir(d);
        if (err != 0) return ErrnoStatus(err, "list", full);
        break;
      }
      if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
      names.emplace_back(e->d_name);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  Status CreateDirs(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", true));
    NEBULITE_RETURN_IF_ERROR(Writable());
    return MakeDirs(Full(dir), modes_);
  }

  Status Rename(const std::string& from, const std::string& to) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(from, "rename source", false));
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(to, "rename target", false));
    NEBULITE_RETURN_IF_ERROR(Writable());
    const std::string full_from = Full(from);
    const std::string full_to = Full(to);
    if (::rename(full_from.c_str(), full_to.c_str()) != 0) {
      return ErrnoStatus(errno, "rename to '" + full_to + "' of", full_from);
    }
    return Status::OK();
  }

  Status SyncDir(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", true));
    NEBULITE_RETURN_IF_ERROR(Writable());
    const std::string full = Full(dir);
    if (int err = FsyncDirectory(full); err != 0) return ErrnoStatus(err, "fsync directory", full);
    return Status::OK();
  }

  Status Delete(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    NEBULITE_RETURN_IF_ERROR(Writable());
    NEBULITE_RETURN_IF_ERROR(RefuseSymlinks(path, /*including_last=*/false));
    const std::string full = Full(path);
    // ENOTDIR: a file stands where a parent directory would be, so `path` does not exist.
    if (::unlink(full.c_str()) != 0 && errno != ENOENT && errno != ENOTDIR)
      return ErrnoStatus(errno, "delete", full);
    return Status::OK();
  }

  Status DeleteRecursively(const std::string& dir) override {
    // Deleting the whole root is never what a caller means.
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", false));
    NEBULITE_RETURN_IF_ERROR(Writable());
    NEBULITE_RETURN_IF_ERROR(RefuseSymlinks(dir, /*including_last=*/true));
    return RemoveTree(Full(dir));
  }

  Result<bool> RemoveDirIfEmpty(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", false));
    NEBULITE_RETURN_IF_ERROR(Writable());
    NEBULITE_RETURN_IF_ERROR(RefuseSymlinks(dir, /*including_last=*/false));
    const std::string full = Full(dir);
    if (::rmdir(full.c_str()) == 0 || errno == ENOENT) return true;
    if (errno == ENOTEMPTY || errno == EEXIST) return false;
    if (errno == ENOTDIR) return Status::InvalidArgument("'" + full + "' is not a directory");
    return ErrnoStatus(errno, "remove directory", full);
  }

  Result<std::unique_ptr<StoreLock>> TryLock(const std::string& path, bool exclusive) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "lock path", false));
    const std::string full = Full(path);
    int fd;
    if (options_.read_only) {
      fd = ::open(full.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    } else {
      NEBULITE_RETURN_IF_ERROR(MakeDirs(Full(ParentDir(path)), modes_));
      // The owner's only: a shared lock taken by anyone who can read the file would keep
      // the run it marks alive for ever (see commit/runs.cc).
      fd = ::open(full.c_str(), O_RDWR | O_CREAT | O_NONBLOCK | O_CLOEXEC, 0600);
    }
    if (fd < 0) return ErrnoStatus(errno, "open lock", full);
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return Status::InvalidArgument("lock '" + full + "' is not a regular file");
    }
    int rc;
    do {
      rc = ::flock(fd, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      int err = errno;
      ::close(fd);
      if (err == EWOULDBLOCK) return std::unique_ptr<StoreLock>();
      return ErrnoStatus(err, "lock", full);
    }
    return std::unique_ptr<StoreLock>(new PosixLock(fd));
  }

 private:
  std::string Full(const std::string& path) const {
    if (path.empty()) return root_;
    if (root_ == "/") return "/" + path;
    return root_ + "/" + path;
  }

  Status Writable() const {
    if (!options_.read_only) return Status::OK();
    return Status::PermissionDenied("the store '" + root_ + "' is opened read-only");
  }

  // Steps 1-4 of the atomic write protocol (see the top of this file); with `exclusive`,
  // step 3 is link(), which fails if the target exists, instead of rename().
  Status WriteViaTemp(const std::string& path, const std::string& data, bool exclusive,
                      bool owner_only = false) {
    const CreateModes modes = owner_only ? CreateModes(0600) : modes_;
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    NEBULITE_RETURN_IF_ERROR(Writable());
    const std::string dir = ParentDir(path);
    NEBULITE_RETURN_IF_ERROR(MakeDirs(Full(dir), modes_));
    std::string name = BaseName(path);
    // Keep the temporary name under NAME_MAX even for a 255-byte target name.
    if (name.size() > 200) name.resize(200);
    const std::string full = Full(path);
    const std::string temp = Full(JoinPath(dir, "." + name + ".tmp." + std::to_string(::getpid()) +
                                                    "." + std::to_string(++g_temp_counter)));
    // 1. Write the temporary file.
    int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, modes.open_file());
    if (fd < 0) return ErrnoStatus(errno, "create", temp);
    FdCloser closer(fd);
    auto fail = [&](int err, const char* what) {
      closer.CloseNow();
      ::unlink(temp.c_str());
      return ErrnoStatus(err, what, temp);
    };
    if (int err = ApplyFileMode(fd, modes); err != 0) return fail(err, "set the mode of");
    if (int err = PwriteFully(fd, data.data(), data.size(), 0); err != 0) return fail(err, "write");
    // 2. Make its bytes durable.
    if (::fsync(fd) != 0) return fail(errno, "fsync");
    if (closer.CloseNow() != 0) return fail(errno, "close");
    // 3. Atomically give it its name.
    if (exclusive) {
      if (::link(temp.c_str(), full.c_str()) != 0) {
        int err = errno;
        ::unlink(temp.c_str());
        if (err == EEXIST) return Status::AlreadyExists("'" + full + "' already exists");
        return ErrnoStatus(err, "link to '" + full + "' of", temp);
      }
      ::unlink(temp.c_str());
    } else if (::rename(temp.c_str(), full.c_str()) != 0) {
      int err = errno;
      ::unlink(temp.c_str());
      return ErrnoStatus(err, "rename to '" + full + "' of", temp);
    }
    // 4. Make the new name durable.
    const std::string full_dir = Full(dir);
    if (int err = FsyncDirectory(full_dir); err != 0) {
      return ErrnoStatus(err, "fsync directory", full_dir);
    }
    return Status::OK();
  }

  // Deletions never go through a symbolic link below the root (nor, with
  // `including_last`, remove one): a link may lead out of the store, and nebulite never
  // creates one, so whatever it leads to is not nebulite's.
  Status RefuseSymlinks(const std::string& path, bool including_last) const {
    size_t end = 0;
    while (end != std::string::npos) {
      end = path.find('/', end + 1);
      if (end == std::string::npos && !including_last) break;
      const std::string full = Full(path.substr(0, end));
      struct stat st;
      if (::lstat(full.c_str(), &st) != 0) return Status::OK();  // missing: nothing to follow
      if (S_ISLNK(st.st_mode)) {
        return Status::InvalidArgument("'" + full + "' is a symbolic link: nebulite never " +
                                       "deletes through one");
      }
    }
    return Status::OK();
  }

  // Removes `full` and everything below it without following symlinks.
  static Status RemoveTree(const std::string& full) {
    struct stat st;
    if (::lstat(full.c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return Status::OK();  // (a parent is a file)
      return ErrnoStatus(errno, "stat", full);
    }
    if (!S_ISDIR(st.st_mode)) {
      if (::unlink(full.c_str()) != 0 && errno != ENOENT) return ErrnoStatus(errno, "delete", full);
      return Status::OK();
    }
    std::vector<std::string> children;
    DIR* d = ::opendir(full.c_str());
    if (d == nullptr) {
      if (errno == ENOENT) return Status::OK();
      return ErrnoStatus(errno, "list", full);
    }
    while (struct dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
      children.push_back(full + "/" + e->d_name);
    }
    ::closedir(d);
    for (const std::string& child : children) NEBULITE_RETURN_IF_ERROR(RemoveTree(child));
    if (::rmdir(full.c_str()) != 0 && errno != ENOENT) return ErrnoStatus(errno, "remove", full);
    return Status::OK();
  }

  const std::string root_;
  const PosixOptions options_;
  const CreateModes modes_;
};

}  // namespace

Status ValidateFileMode(uint32_t mode) {
  if (mode == 0 || (mode <= 0777 && (mode & 0600) == 0600)) return Status::OK();
  char text[16];
  std::snprintf(text, sizeof text, "0%o", mode);
  return Status::InvalidArgument(std::string("file_mode ") + text +
                                 " must be a permission mode of at most 0777 that lets its "
                                 "owner read and write (0600, 0640, 0644, ...)");
}

Result<std::unique_ptr<Storage>> OpenPosixStorage(const std::string& root,
                                                  const PosixOptions& options) {
  if (root.empty()) return Status::InvalidArgument("posix storage root is empty");
  if (root.find('\0') != std::string::npos) {
    return Status::InvalidArgument("posix storage root contains a NUL byte");
  }
  std::string clean = root;
  while (clean.size() > 1 && clean.back() == '/') clean.pop_back();

  struct stat st;
  if (options.read_only) {
    if (::stat(clean.c_str(), &st) != 0) return ErrnoStatus(errno, "open storage root", clean);
    if (!S_ISDIR(st.st_mode)) {
      return Status::InvalidArgument("storage root '" + clean + "' is not a directory");
    }
    return std::unique_ptr<Storage>(new PosixStorage(clean, options));
  }
  if (::stat(clean.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument("storage root '" + clean + "' is not a directory");
  }
  NEBULITE_RETURN_IF_ERROR(ValidateFileMode(options.file_mode));
  Status made = MakeDirs(clean, CreateModes(options.file_mode));
  if (!made.ok()) {
    return Status(made.code(), "cannot create storage root '" + clean + "': " + made.message());
  }
  if (::stat(clean.c_str(), &st) != 0) return ErrnoStatus(errno, "stat storage root", clean);
  if (!S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument("storage root '" + clean + "' is not a directory");
  }
  auto not_writable = [&](int err) {
    return Status::PermissionDenied("storage root '" + clean +
                                    "' is not writable: " + std::strerror(err));
  };
  if (::access(clean.c_str(), W_OK | X_OK) != 0) return not_writable(errno);
  // access() ignores read-only mounts in some setups and is not authoritative for root:
  // create and remove a probe file to be sure.
  const std::string probe = (clean == "/" ? "" : clean) + "/.nebulite-probe." +
                            std::to_string(::getpid()) + "." + std::to_string(++g_temp_counter);
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    int err = errno;
    if (err == EACCES || err == EPERM || err == EROFS) return not_writable(err);
    return ErrnoStatus(err, "create probe file", probe);
  }
  ::close(fd);
  if (::unlink(probe.c_str()) != 0) return ErrnoStatus(errno, "remove probe file", probe);
  return std::unique_ptr<Storage>(new PosixStorage(clean, options));
}

}  // namespace nebulite
