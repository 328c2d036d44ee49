#include "transport/shm/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "common/checks.h"
#include "common/log.h"

namespace epcomm {
namespace {

constexpr uint64_t kRegionMagic = 0x65706373686d3031ull;  // "epcshm01"
constexpr size_t kHeaderBytes = 4096;

size_t align64(size_t n) { return (n + 63) & ~size_t{63}; }
size_t slotBytes(size_t ring_bytes) { return sizeof(RingCtl) + align64(ring_bytes); }

}  // namespace

std::string shmRegionName(const uint8_t* secret, int rank) {
  char name[64];
  snprintf(name, sizeof(name), "/epcomm-%02x%02x%02x%02x%02x%02x%02x%02x-%d", secret[0], secret[1], secret[2],
           secret[3], secret[4], secret[5], secret[6], secret[7], rank);
  return name;
}

size_t ShmRegion::bytesFor(int nranks, int nchannels, size_t ring_bytes) {
  return kHeaderBytes + static_cast<size_t>(nranks) * nchannels * slotBytes(ring_bytes);
}

ShmRegion::~ShmRegion() {
  if (linked_) unlink();
  unmap();
}

epResult_t ShmRegion::create(const std::string& name, int rank, int nranks, int nchannels, size_t ring_bytes) {
  bytes_ = bytesFor(nranks, nchannels, ring_bytes);
  ring_bytes_ = ring_bytes;
  nchannels_ = nchannels;
  name_ = name;
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) EP_FAIL(epSystemError, "shm_open(%s) failed: %s", name.c_str(), strerror(errno));
  owner_ = true;
  linked_ = true;
  if (ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
    int e = errno;
    close(fd);
    EP_FAIL(epSystemError, "ftruncate of shared memory %s to %zu bytes failed: %s (is /dev/shm large enough?)",
            name.c_str(), bytes_, strerror(e));
  }
  base_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  close(fd);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    EP_FAIL(epSystemError, "mmap of shared memory %s (%zu bytes) failed: %s", name.c_str(), bytes_, strerror(e));
  }
  initHeader(rank, nranks, nchannels, ring_bytes);  // touched: a short /dev/shm fails here
  EP_INFO(kSubsysShm, "created shared region %s: %zu bytes, %d x %d rings of %zu bytes", name.c_str(), bytes_,
          nranks, nchannels, ring_bytes);
  return epSuccess;
}

epResult_t ShmRegion::createPrivate(int rank, int nranks, int nchannels, size_t ring_bytes) {
  bytes_ = bytesFor(nranks, nchannels, ring_bytes);
  ring_bytes_ = ring_bytes;
  nchannels_ = nchannels;
  name_.clear();
  base_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base_ == MAP_FAILED) {
    const int e = errno;
    base_ = nullptr;
    EP_FAIL(epSystemError, "mmap of %zu bytes of private ring memory failed: %s", bytes_, strerror(e));
  }
  owner_ = true;
  initHeader(rank, nranks, nchannels, ring_bytes);
  return epSuccess;
}

void ShmRegion::initHeader(int rank, int nranks, int nchannels, size_t ring_bytes) {
  // Fresh pages are zero, so the ring counters start at 0.
  RegionHeader* h = header();
  h->magic = kRegionMagic;
  h->version = EPCOMM_VERSION_CODE;
  h->rank = rank;
  h->nranks = nranks;
  h->nchannels = nchannels;
  h->pid = getpid();
  h->ring_bytes = ring_bytes;
  h->ready.store(1, std::memory_order_release);
}

epResult_t ShmRegion::open(const std::string& name, int expect_rank, int nranks, int nchannels,
                           size_t ring_bytes) {
  bytes_ = bytesFor(nranks, nchannels, ring_bytes);
  ring_bytes_ = ring_bytes;
  nchannels_ = nchannels;
  name_ = name;
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0)
    EP_FAIL(epSystemError, "cannot open rank %d's shared memory %s: %s (is it on another host?)", expect_rank,
            name.c_str(), strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes_) {
    close(fd);
    EP_FAIL(epInternalError, "rank %d's shared memory %s has %lld bytes, expected %zu", expect_rank, name.c_str(),
            static_cast<long long>(st.st_size), bytes_);
  }
  base_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  close(fd);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    EP_FAIL(epSystemError, "mmap of rank %d's shared memory failed: %s", expect_rank, strerror(e));
  }
  RegionHeader* h = header();
  if (h->ready.load(std::memory_order_acquire) != 1 || h->magic != kRegionMagic || h->rank != expect_rank ||
      h->nranks != nranks || h->nchannels != nchannels || h->ring_bytes != ring_bytes)
    EP_FAIL(epInternalError, "rank %d's shared memory %s has an unexpected header", expect_rank, name.c_str());
  return epSuccess;
}

epResult_t ShmRegion::unlink() {
  if (!linked_) return epSuccess;
  linked_ = false;
  if (shm_unlink(name_.c_str()) != 0 && errno != ENOENT)
    EP_FAIL(epSystemError, "shm_unlink(%s) failed: %s", name_.c_str(), strerror(errno));
  return epSuccess;
}

void ShmRegion::unmap() {
  if (base_ != nullptr) munmap(base_, bytes_);
  base_ = nullptr;
}

RingCtl* ShmRegion::ringCtl(int src, int ch) const {
  uint8_t* p = static_cast<uint8_t*>(base_) + kHeaderBytes +
               (static_cast<size_t>(src) * nchannels_ + ch) * slotBytes(ring_bytes_);
  return reinterpret_cast<RingCtl*>(p);
}

uint8_t* ShmRegion::ringData(int src, int ch) const {
  return reinterpret_cast<uint8_t*>(ringCtl(src, ch)) + sizeof(RingCtl);
}

// ---- RingEnd ----

size_t RingEnd::freeBytes() const {
  uint64_t tail = ctl_->tail.load(std::memory_order_relaxed);
  uint64_t head = ctl_->head.load(std::memory_order_acquire);
  return bytes_ - static_cast<size_t>(tail - head);
}

size_t RingEnd::push(const void* src, size_t len) {
  uint64_t tail = ctl_->tail.load(std::memory_order_relaxed);
  uint64_t head = ctl_->head.load(std::memory_order_acquire);
  size_t room = bytes_ - static_cast<size_t>(tail - head);
  size_t n = len < room ? len : room;
  if (n == 0) return 0;
  size_t pos = static_cast<size_t>(tail % bytes_);
  size_t first = bytes_ - pos < n ? bytes_ - pos : n;
  memcpy(data_ + pos, src, first);
  if (n > first) memcpy(data_, static_cast<const uint8_t*>(src) + first, n - first);
  ctl_->tail.store(tail + n, std::memory_order_release);
  return n;
}

size_t RingEnd::available() const {
  uint64_t tail = ctl_->tail.load(std::memory_order_acquire);
  uint64_t head = ctl_->head.load(std::memory_order_relaxed);
  return static_cast<size_t>(tail - head);
}

void RingEnd::copyOut(void* dst, size_t off, size_t len, void* (*copy)(void*, const void*, size_t)) const {
  uint64_t head = ctl_->head.load(std::memory_order_relaxed);
  size_t pos = static_cast<size_t>((head + off) % bytes_);
  size_t first = bytes_ - pos < len ? bytes_ - pos : len;
  copy(dst, data_ + pos, first);
  if (len > first) copy(static_cast<uint8_t*>(dst) + first, data_, len - first);
}

size_t RingEnd::pull(void* dst, size_t len) {
  size_t avail = available();
  size_t n = len < avail ? len : avail;
  if (n == 0) return 0;
  copyOut(dst, 0, n);
  release(n);
  return n;
}

const uint8_t* RingEnd::peek(size_t len) const {
  if (available() < len) return nullptr;
  uint64_t head = ctl_->head.load(std::memory_order_relaxed);
  size_t pos = static_cast<size_t>(head % bytes_);
  if (pos + len > bytes_) return nullptr;
  return data_ + pos;
}

void RingEnd::release(size_t len) {
  uint64_t head = ctl_->head.load(std::memory_order_relaxed);
  ctl_->head.store(head + len, std::memory_order_release);
}

}  // namespace epcomm
