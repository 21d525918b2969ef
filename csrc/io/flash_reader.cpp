// FlashReader: fills rows of a tensor with rows of a file ("bundles" of FFN neurons), with many parallel direct
// reads. Exposed to Python as the TorchScript custom class torch.classes.flashllm.FlashReader.
//
// Rows are fixed-size (read_rows: row i at base + i * row_bytes) or variable-length (read_var_rows: row i spans
// [base + starts[i], base + starts[i + 1]), an Endor neuron: a fixed-size head, its bitmap, then its values). One
// call = one batch: ids are sorted and deduplicated, runs of nearby ids are coalesced into one read when the gap
// costs less than a separate read (gap <= max_gap) or the merged read is still below min_read (see plan(): the
// rule counts rows, so a compressed file merges the same runs as its dense twin), reads are widened to the file's
// direct-I/O alignment (statx STATX_DIOALIGN, else 4 KiB), executed by the engine (a pool of pread workers, or one
// io_uring ring when built with liburing), and each row is copied from the aligned bounce buffer into every output slot
// that asked for it (a variable row: its head into the head output, the rest into the tail output at that slot's
// offset).
#include <Python.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/custom_class.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#ifdef FLASHLLM_WITH_URING
#include <liburing.h>
#endif

namespace flashllm::io {
namespace {

// O_DIRECT needs offsets, sizes and buffers aligned as the file's filesystem and device require. statx reports
// it (STATX_DIOALIGN, Linux 6.1+); where it does not (older kernels, filesystems without the field, buffered
// reads), 4 KiB covers every device.
constexpr int64_t kDefaultDirectAlign = 4096;
// One io_uring request reads at most this much: the SQE length is an unsigned 32-bit field and the CQE result a
// signed 32-bit byte count, so longer reads are split (1 GiB keeps both far from overflow).
constexpr int64_t kMaxUringRequest = int64_t{1} << 30;

bool is_power_of_two(int64_t x) {
  return x > 0 && (x & (x - 1)) == 0;
}

// The direct-I/O alignment of one open file: `offset` for file offsets and lengths, `memory` for buffers.
struct DirectAlign {
  int64_t offset = kDefaultDirectAlign;
  int64_t memory = kDefaultDirectAlign;

  int64_t down(int64_t x) const { return x / offset * offset; }
  int64_t up(int64_t x) const { return (x + offset - 1) / offset * offset; }
};

struct AlignedBuffer {
  char* data = nullptr;
  int64_t size = 0;
  int64_t alignment = 0;
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  AlignedBuffer(AlignedBuffer&& other) noexcept : data(other.data), size(other.size), alignment(other.alignment) {
    other.data = nullptr;
    other.size = 0;
    other.alignment = 0;
  }
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    if (this != &other) {
      std::free(data);
      data = std::exchange(other.data, nullptr);
      size = std::exchange(other.size, 0);
      alignment = std::exchange(other.alignment, 0);
    }
    return *this;
  }
  ~AlignedBuffer() { std::free(data); }
  // At least n bytes starting on an `align` boundary (a power of two); reallocates only to grow or align further.
  char* reserve(int64_t n, int64_t align) {
    if (n > size || align > alignment) {
      std::free(data);
      data = nullptr;
      size = alignment = 0;
      void* p = nullptr;
      // posix_memalign wants a power-of-two multiple of sizeof(void*); a smaller alignment is met by that too.
      const auto effective = static_cast<size_t>(std::max<int64_t>(align, sizeof(void*)));
      TORCH_CHECK(posix_memalign(&p, effective, static_cast<size_t>(n)) == 0, "FlashReader: cannot allocate ", n,
                  " bytes of bounce buffer aligned to ", effective);
      data = static_cast<char*>(p);
      size = n;
      alignment = static_cast<int64_t>(effective);
    }
    return data;
  }
};

// The bounce buffers of one reader's workers, holding at most `limit` bytes at once (idle buffers included; -1: no
// limit): a worker takes one for a read and gives it back, idle ones are reused, and a worker whose read does not fit
// waits for the others to give theirs back. A read larger than the limit is served alone (nothing else held), so the
// most the pool ever holds is max(limit, the longest read), and without a limit one buffer per worker of at most the
// longest read. Every worker holds at most one buffer at a time, so a wait ends.
class BouncePool {
 public:
  explicit BouncePool(int64_t limit) : limit_(limit) {}

  AlignedBuffer acquire(int64_t n, int64_t align) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      auto fits = std::find_if(idle_.begin(), idle_.end(),
                               [&](const AlignedBuffer& b) { return b.size >= n && b.alignment >= align; });
      if (fits != idle_.end()) {
        AlignedBuffer taken = std::move(*fits);
        idle_.erase(fits);
        return taken;
      }
      if (!idle_.empty()) {  // none fits: one goes, so there are never more buffers than workers
        held_ -= idle_.back().size;
        idle_.pop_back();
      }
      while (limit_ >= 0 && held_ + n > limit_ && !idle_.empty()) {  // and more while they crowd out this one
        held_ -= idle_.back().size;
        idle_.pop_back();
      }
      if (limit_ < 0 || held_ + n <= limit_ || held_ == 0) break;
      freed_.wait(lock);
    }
    held_ += n;
    lock.unlock();
    AlignedBuffer buffer;
    try {
      buffer.reserve(n, align);
    } catch (...) {
      give_back_bytes(n);
      throw;
    }
    return buffer;
  }

  void release(AlignedBuffer buffer) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      idle_.push_back(std::move(buffer));
    }
    freed_.notify_all();
  }

  int64_t held() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_;
  }

 private:
  void give_back_bytes(int64_t n) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      held_ -= n;
    }
    freed_.notify_all();
  }

  const int64_t limit_;
  int64_t held_ = 0;  // bytes of every buffer handed out or idle
  std::vector<AlignedBuffer> idle_;
  mutable std::mutex mutex_;
  std::condition_variable freed_;
};

// One coalesced read: the file range [offset, offset + length) covers sorted rows [first, last) of the batch.
struct Read {
  int64_t offset;
  int64_t length;
  int64_t first;
  int64_t last;
};

// Shared state of one call; every task reports to it exactly once, so the caller never waits forever.
struct Batch {
  std::vector<Read> reads;
  std::vector<std::pair<int64_t, int64_t>> rows;  // (id, output slot), sorted by id
  int64_t base = 0;
  // Fixed rows: their size. Variable rows: the bytes one row counts for in the coalescing rule (the dense row an
  // Endor row compresses), so the rule counts rows, whatever their stored length.
  int64_t row_bytes = 0;
  char* out = nullptr;  // fixed rows: slot i at out + i * row_bytes; variable rows: the heads, head_bytes each
  // Variable rows: row id spans [base + starts[id], base + starts[id + 1]); its first head_bytes go to the head
  // output, the rest to tail + tail_offsets[slot].
  const int64_t* starts = nullptr;
  int64_t head_bytes = 0;
  char* tail = nullptr;
  const int64_t* tail_offsets = nullptr;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> bytes_read{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::condition_variable done_cv;
  int64_t pending = 0;
  std::string error;
  std::vector<at::Tensor> keep;  // tensors the raw pointers above point into, alive until the reads are done

  void fail(std::string message) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!failed.exchange(true)) error = std::move(message);
  }
  // File range [begin(id), end(id)) of a row.
  int64_t begin(int64_t id) const { return base + (starts ? starts[id] : id * row_bytes); }
  int64_t end(int64_t id) const { return base + (starts ? starts[id + 1] : (id + 1) * row_bytes); }
  // Copies the rows of read `r` out of the bounce buffer `buf`, which holds the file from byte `buf_start` on.
  void scatter(const Read& r, const char* buf, int64_t buf_start) const {
    for (int64_t k = r.first; k < r.last; ++k) {
      const auto [id, slot] = rows[k];
      const char* src = buf + (begin(id) - buf_start);
      if (starts == nullptr) {
        std::memcpy(out + slot * row_bytes, src, row_bytes);
      } else {
        std::memcpy(out + slot * head_bytes, src, head_bytes);
        std::memcpy(tail + tail_offsets[slot], src + head_bytes, end(id) - begin(id) - head_bytes);
      }
    }
  }
};

// Calls with the GIL released when the caller holds it (Python), untouched otherwise (TorchScript, C++).
class GilRelease {
 public:
  GilRelease() : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilRelease() {
    if (state_) PyEval_RestoreThread(state_);
  }

 private:
  PyThreadState* state_;
};

class ThreadPool {
 public:
  explicit ThreadPool(int64_t n) {
    for (int64_t i = 0; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
  }
  int64_t size() const { return static_cast<int64_t>(workers_.size()); }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  std::vector<std::thread> workers_;
  std::deque<std::function<void()>> queue_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
};

}  // namespace

class FlashReader : public torch::CustomClassHolder {
 public:
  // bounce_limit: the most bytes the bounce buffers hold at once (-1: no limit; see BouncePool).
  FlashReader(std::string path, int64_t threads, int64_t min_read, int64_t max_gap, int64_t max_read, bool direct,
              std::string engine, int64_t bounce_limit)
      : path_(std::move(path)),
        min_read_(min_read),
        max_gap_(max_gap),
        max_read_(max_read),
        bounce_limit_(bounce_limit),
        bounce_(bounce_limit),
        engine_(engine) {
    TORCH_CHECK(bounce_limit >= -1, "FlashReader: bounce_limit must be >= -1, got ", bounce_limit);
    TORCH_CHECK(threads >= 1 && threads <= 1024, "FlashReader: threads must be in [1, 1024], got ", threads);
    TORCH_CHECK(min_read >= 0 && max_gap >= -1, "FlashReader: min_read must be >= 0 and max_gap >= -1, got ", min_read,
                " and ", max_gap);
    TORCH_CHECK(max_read >= kDefaultDirectAlign, "FlashReader: max_read must be at least ", kDefaultDirectAlign,
                " bytes, got ", max_read);
    TORCH_CHECK(engine == "threads" || engine == "io_uring",
                "FlashReader: engine must be 'threads' or 'io_uring', got '", engine, "'");
#ifndef FLASHLLM_WITH_URING
    TORCH_CHECK(engine == "threads",
                "FlashReader: engine 'io_uring' requested but this build has no liburing "
                "(install liburing-dev and rebuild)");
#endif
    fd_ = -1;
    if (direct) {
      fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
      // Filesystems without O_DIRECT answer EINVAL: fall back to buffered reads; `direct` reports which is in use.
      direct_ = fd_ >= 0;
      if (fd_ < 0 && errno != EINVAL) open_failed();
    }
    if (fd_ < 0) fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) open_failed();
    struct stat st;
    if (::fstat(fd_, &st) == 0 && S_ISDIR(st.st_mode)) {
      ::close(fd_);
      TORCH_CHECK(false, "FlashReader: ", path_, " is a directory");
    }
    align_ = query_direct_alignment(fd_, direct_);
    max_request_ = std::max(align_.offset, align_.down(std::min(max_read_, kMaxUringRequest)));
    threads_ = threads;
    if (engine_ == "threads") pool_ = std::make_unique<ThreadPool>(threads);
#ifdef FLASHLLM_WITH_URING
    if (engine_ == "io_uring") {
      const int rc = io_uring_queue_init(static_cast<unsigned>(threads), &ring_, 0);
      if (rc < 0) {
        ::close(fd_);
        TORCH_CHECK(false, "FlashReader: io_uring_queue_init failed: ", std::strerror(-rc));
      }
    }
#endif
  }

  ~FlashReader() override {
    pool_.reset();  // joins the workers before the fd goes away
#ifdef FLASHLLM_WITH_URING
    if (engine_ == "io_uring") io_uring_queue_exit(&ring_);
#endif
    if (fd_ >= 0) ::close(fd_);
  }

  // out[i] = file[base + ids[i] * row_bytes : + row_bytes] for ids in [0, n_rows).
  // Returns the stats of the call: bytes requested, bytes read (incl. alignment padding and coalesced gaps),
  // number of reads, wall time in ns.
  std::vector<int64_t> read_rows(int64_t base, int64_t row_bytes, int64_t n_rows, const at::Tensor& ids,
                                 const at::Tensor& out) {
    const auto start = std::chrono::steady_clock::now();
    auto batch = fixed_batch(base, row_bytes, n_rows, ids);
    const int64_t n = ids.numel();
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous(), "FlashReader: out must be a contiguous CPU tensor");
    // ids may repeat, so n can exceed n_rows: the checks of fixed_batch do not bound n * row_bytes.
    TORCH_CHECK(n == 0 || row_bytes <= std::numeric_limits<int64_t>::max() / n, "FlashReader: ", n, " rows of ",
                row_bytes, " bytes overflow an output size");
    TORCH_CHECK(out.nbytes() == static_cast<size_t>(n * row_bytes), "FlashReader: out holds ", out.nbytes(), " bytes, ",
                n, " rows of ", row_bytes, " bytes need ", n * row_bytes);
    batch->out = static_cast<char*>(out.data_ptr());
    return execute(batch, start);
  }

  // Variable-length rows: row id of the file spans [base + starts[id], base + starts[id + 1]) (starts int64
  // [n_rows + 1], non-decreasing where read); its first head_bytes go to head_out[i] (uint8 [k * head_bytes]), the
  // rest to tail_out[tail_offsets[i]:] (tail_offsets int64 [k + 1], each slot's share exactly the row's rest).
  // unit_bytes: what one row counts for in the coalescing rule (the dense row it compresses; see plan()).
  // Returns read_rows' stats.
  std::vector<int64_t> read_var_rows(int64_t base, const at::Tensor& starts, int64_t unit_bytes, int64_t head_bytes,
                                     const at::Tensor& ids, const at::Tensor& head_out, const at::Tensor& tail_out,
                                     const at::Tensor& tail_offsets) {
    const auto start = std::chrono::steady_clock::now();
    auto batch = var_batch(base, starts, unit_bytes, head_bytes, ids);
    const int64_t n = ids.numel();
    for (const auto* t : {&head_out, &tail_out})
      TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(),
                  "FlashReader: head_out and tail_out must be contiguous "
                  "CPU tensors");
    TORCH_CHECK(n == 0 || head_bytes <= std::numeric_limits<int64_t>::max() / n, "FlashReader: ", n,
                " heads overflow an output size");
    TORCH_CHECK(head_out.nbytes() == static_cast<size_t>(n * head_bytes), "FlashReader: head_out holds ",
                head_out.nbytes(), " bytes, ", n, " heads of ", head_bytes, " bytes need ", n * head_bytes);
    TORCH_CHECK(tail_offsets.device().is_cpu() && tail_offsets.scalar_type() == at::kLong && tail_offsets.dim() == 1 &&
                    tail_offsets.numel() == n + 1 && tail_offsets.is_contiguous(),
                "FlashReader: tail_offsets must be a contiguous 1-D int64 CPU tensor of ", n + 1, " entries");
    const int64_t* tail_at = tail_offsets.data_ptr<int64_t>();
    const auto tail_bytes = static_cast<int64_t>(tail_out.nbytes());
    for (const auto& [id, slot] : batch->rows) {
      const int64_t rest = batch->end(id) - batch->begin(id) - head_bytes;
      TORCH_CHECK(tail_at[slot] >= 0 && tail_at[slot] <= tail_bytes - rest && tail_at[slot + 1] - tail_at[slot] == rest,
                  "FlashReader: tail_offsets[", slot, "]=", tail_at[slot], " does not hold the ", rest,
                  " bytes of row ", id, " inside tail_out's ", tail_bytes, " bytes");
    }
    batch->out = static_cast<char*>(head_out.data_ptr());
    batch->tail = static_cast<char*>(tail_out.data_ptr());
    batch->tail_offsets = tail_at;
    return execute(batch, start);
  }

  // The coalesced reads a call would issue, without reading: int64 [n_reads, 2] of (file offset, length), in file
  // order, before widening to the direct-I/O alignment. Rows are fixed (starts undefined) or variable as above
  // (row_bytes then their unit_bytes; n_rows unused).
  at::Tensor plan_reads(int64_t base, int64_t row_bytes, int64_t n_rows, const c10::optional<at::Tensor>& starts,
                        const at::Tensor& ids) {
    auto batch = starts ? var_batch(base, *starts, row_bytes, 0, ids) : fixed_batch(base, row_bytes, n_rows, ids);
    std::sort(batch->rows.begin(), batch->rows.end());
    plan(*batch);
    auto out = at::empty({static_cast<int64_t>(batch->reads.size()), 2}, at::kLong);
    auto* p = out.data_ptr<int64_t>();
    for (const Read& r : batch->reads) {
      *p++ = r.offset;
      *p++ = r.length;
    }
    return out;
  }

  bool direct() const { return direct_; }
  int64_t threads() const { return threads_; }
  std::string engine() const { return engine_; }
  std::string path() const { return path_; }
  int64_t dio_offset_align() const { return align_.offset; }
  int64_t dio_mem_align() const { return align_.memory; }
  // Bytes the reader's bounce buffers hold now (in use or idle, kept for the next call): at most
  // max(bounce_limit, the longest read), what FlashReader.bounce_bound bounds.
  int64_t bounce_bytes() const {
    int64_t ring = 0;
#ifdef FLASHLLM_WITH_URING
    std::lock_guard<std::mutex> ring_lock(ring_mutex_);
    for (const auto& buffer : ring_buffers_) ring += buffer.size;
#endif
    return bounce_.held() + ring;
  }

 private:
  // The (id, slot) pairs of a call, ids checked against [0, n_rows).
  static std::shared_ptr<Batch> new_batch(const at::Tensor& ids, int64_t n_rows) {
    TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1,
                "FlashReader: ids must be a 1-D int64 CPU tensor, got ", ids.scalar_type(), " ", ids.sizes(), " on ",
                ids.device());
    auto batch = std::make_shared<Batch>();
    const int64_t n = ids.numel();
    const at::Tensor ids_c = ids.contiguous();
    const int64_t* id = ids_c.data_ptr<int64_t>();
    batch->rows.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < n_rows, "FlashReader: neuron id ", id[i], " at position ", i, " outside [0, ",
                  n_rows, ")");
      batch->rows.emplace_back(id[i], i);
    }
    return batch;
  }

  static std::shared_ptr<Batch> fixed_batch(int64_t base, int64_t row_bytes, int64_t n_rows, const at::Tensor& ids) {
    TORCH_CHECK(base >= 0 && row_bytes > 0 && n_rows >= 0,
                "FlashReader: need base >= 0, row_bytes > 0, "
                "n_rows >= 0, got ",
                base, ", ", row_bytes, ", ", n_rows);
    TORCH_CHECK(n_rows == 0 || row_bytes <= (std::numeric_limits<int64_t>::max() - base) / n_rows,
                "FlashReader: base + n_rows * row_bytes overflows a file offset");
    auto batch = new_batch(ids, n_rows);
    batch->base = base;
    batch->row_bytes = row_bytes;
    return batch;
  }

  // Checks every row the call touches: it starts at or after 0, holds its head and ends inside a file offset.
  static std::shared_ptr<Batch> var_batch(int64_t base, const at::Tensor& starts, int64_t unit_bytes,
                                          int64_t head_bytes, const at::Tensor& ids) {
    TORCH_CHECK(
        starts.device().is_cpu() && starts.scalar_type() == at::kLong && starts.dim() == 1 && starts.numel() >= 1,
        "FlashReader: starts must be a 1-D int64 CPU tensor of n_rows + 1 entries");
    TORCH_CHECK(base >= 0 && head_bytes >= 0 && unit_bytes > 0,
                "FlashReader: need base >= 0, head_bytes >= 0 and "
                "unit_bytes > 0, got ",
                base, ", ", head_bytes, ", ", unit_bytes);
    const int64_t n_rows = starts.numel() - 1;
    // plan() measures spans as rows x unit_bytes: keep that inside an int64 as fixed_batch does.
    TORCH_CHECK(n_rows == 0 || unit_bytes <= std::numeric_limits<int64_t>::max() / (n_rows + 1),
                "FlashReader: ", n_rows, " rows of ", unit_bytes, " unit bytes overflow an int64");
    auto batch = new_batch(ids, n_rows);
    batch->base = base;
    batch->row_bytes = unit_bytes;
    batch->head_bytes = head_bytes;
    batch->keep = {starts.contiguous()};
    const int64_t* at = batch->keep[0].data_ptr<int64_t>();
    batch->starts = at;
    for (const auto& [id, slot] : batch->rows) {
      TORCH_CHECK(
          at[id] >= 0 && at[id + 1] - at[id] >= head_bytes && at[id + 1] <= std::numeric_limits<int64_t>::max() - base,
          "FlashReader: row ", id, " spans [", at[id], ", ", at[id + 1], "): needs 0 <= start, at least ", head_bytes,
          " bytes, and an end inside a file offset");
    }
    return batch;
  }

  // Plans, runs and checks a batch; returns the stats of read_rows.
  std::vector<int64_t> execute(const std::shared_ptr<Batch>& batch, std::chrono::steady_clock::time_point start) {
    int64_t requested = 0;
    {
      GilRelease no_gil;
      std::sort(batch->rows.begin(), batch->rows.end());
      plan(*batch);
      if (!batch->reads.empty()) {
        if (engine_ == "threads")
          run_threads(batch);
        else
          run_uring(*batch);
      }
      const auto& rows = batch->rows;
      for (size_t k = 0; k < rows.size(); ++k)
        if (k == 0 || rows[k].first != rows[k - 1].first)
          requested += batch->end(rows[k].first) - batch->begin(rows[k].first);
    }
    // A worker may drop the last reference to the batch: the tensors must not go with it (one that Python also
    // holds needs the GIL to be freed, which this thread holds while a reader closes and joins its workers).
    batch->keep.clear();
    batch->starts = nullptr;
    TORCH_CHECK(!batch->failed.load(), batch->error);
    const auto wall = std::chrono::steady_clock::now() - start;
    return {requested, batch->bytes_read.load(), static_cast<int64_t>(batch->reads.size()),
            std::chrono::duration_cast<std::chrono::nanoseconds>(wall).count()};
  }

  [[noreturn]] void open_failed() {
    const int err = errno;
    TORCH_CHECK(false, "FlashReader: cannot open ", path_, ": ", std::strerror(err), " (errno ", err, ")");
    std::abort();
  }

  // Coalescing: extending a read over a gap costs gap/bandwidth, a separate read costs its latency; max_gap is
  // their break-even (latency x bandwidth, from `flashllm calibrate-disk`). Reads below min_read absorb the next
  // row whatever the gap, since the device serves small reads at nearly the same cost. max_gap = -1 with
  // min_read = 0 turns coalescing off: one read per distinct row, even for adjacent rows (baselines).
  // The rule counts rows: a gap or a read measures rows x row_bytes, which for fixed rows is their bytes and for
  // variable rows their unit (the dense row). Counting a compressed file's own bytes would read through more
  // unrequested rows than its dense twin (its rows are shorter, so more of them fit a gap); counting rows, both
  // merge the same runs and the compressed one reads fewer bytes. max_read therefore caps a read at
  // max_read / unit_bytes rows (a variable row longer than its unit, incompressible, makes the read that longer).
  void plan(Batch& b) const {
    const auto& rows = b.rows;
    int64_t k = 0;
    const int64_t n = static_cast<int64_t>(rows.size());
    while (k < n) {
      const int64_t first_id = rows[k].first;
      int64_t last_id = first_id;
      int64_t end = k + 1;
      while (end < n) {
        const int64_t next_id = rows[end].first;
        if (next_id != last_id) {
          const int64_t gap = (next_id - last_id - 1) * b.row_bytes;
          const int64_t merged = (next_id - first_id + 1) * b.row_bytes;
          if (merged > max_read_ || (gap > max_gap_ && merged > min_read_)) break;
          last_id = next_id;
        }
        ++end;
      }
      b.reads.push_back({b.begin(first_id), b.end(last_id) - b.begin(first_id), k, end});
      k = end;
    }
  }

  std::string io_error(const char* what, int err, int64_t offset, int64_t length) const {
    return std::string("FlashReader: ") + what + " reading " + path_ + " at offset " + std::to_string(offset) + " (" +
           std::to_string(length) + " bytes): " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
  }

  // Reads file bytes [start, start + want) into buf, of which the first `need` must arrive (the tail past the data
  // may lie beyond the end of the file). Returns bytes transferred; on failure sets the batch error.
  int64_t read_span(Batch& b, int64_t start, int64_t want, int64_t need, char* buf) const {
    int64_t got = 0;
    int stalls = 0;
    while (got < need) {
      const ssize_t n = ::pread(fd_, buf + got, static_cast<size_t>(want - got), start + got);
      if (n < 0) {
        if (errno == EINTR) continue;
        b.fail(io_error("pread failed", errno, start + got, want - got));
        return got;
      }
      // A short direct read can end mid-block; the next one must start aligned again, so a read shorter than a block
      // makes no progress. Only such reads count as stalls: a long read may legitimately arrive in many pieces.
      const int64_t before = got;
      got += n;
      if (got < need && direct_) got = align_.down(got);
      stalls = got > before ? 0 : stalls + 1;
      if (n == 0 || stalls > 16) {
        b.fail(io_error("unexpected end of file (file shorter than the store says?)", EIO, start + got, want - got));
        return got;
      }
    }
    return got;
  }

  // Where a read can land straight in `out`: its rows are distinct consecutive neurons going to consecutive
  // output slots, and offset, length and destination meet the direct-I/O alignment. Else nullptr (bounce buffer).
  char* zero_copy_target(const Batch& b, const Read& r) const {
    if (b.starts != nullptr) return nullptr;  // variable rows are split into head and tail: always a bounce buffer
    const auto& first = b.rows[r.first];
    for (int64_t k = r.first + 1; k < r.last; ++k)
      if (b.rows[k].first != first.first + (k - r.first) || b.rows[k].second != first.second + (k - r.first))
        return nullptr;
    char* dst = b.out + first.second * b.row_bytes;
    const bool aligned = r.offset % align_.offset == 0 && r.length % align_.offset == 0 &&
                         reinterpret_cast<uintptr_t>(dst) % align_.memory == 0;
    return aligned || !direct_ ? dst : nullptr;
  }

  // The file's direct-I/O alignment from statx; the 4 KiB default where the kernel or filesystem reports none (or
  // something unusable), and for buffered reads, where 4 KiB keeps reads on page boundaries.
  static DirectAlign query_direct_alignment(int fd, bool direct) {
    DirectAlign align;
#ifdef STATX_DIOALIGN  // Linux 6.1 headers; older ones lack the field and the flag
    struct statx sx;
    if (direct && ::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
        is_power_of_two(sx.stx_dio_offset_align) && is_power_of_two(sx.stx_dio_mem_align)) {
      align.offset = sx.stx_dio_offset_align;
      align.memory = sx.stx_dio_mem_align;
    }
#else
    (void)fd;
    (void)direct;
#endif
    return align;
  }

  void run_threads(const std::shared_ptr<Batch>& batch) {
    const int64_t n_tasks = std::min<int64_t>(pool_->size(), batch->reads.size());
    batch->pending = n_tasks;
    for (int64_t t = 0; t < n_tasks; ++t) {
      pool_->submit([this, batch] {
        Batch& b = *batch;
        try {
          for (int64_t i = b.next++; i < static_cast<int64_t>(b.reads.size()) && !b.failed.load(); i = b.next++) {
            const Read& r = b.reads[i];
            if (char* dst = zero_copy_target(b, r)) {
              b.bytes_read += read_span(b, r.offset, r.length, r.length, dst);
              continue;
            }
            const int64_t start = align_.down(r.offset);
            const int64_t want = align_.up(r.offset + r.length) - start;
            AlignedBuffer buffer = bounce_.acquire(want, align_.memory);
            b.bytes_read += read_span(b, start, want, r.offset + r.length - start, buffer.data);
            if (!b.failed.load()) b.scatter(r, buffer.data, start);
            bounce_.release(std::move(buffer));
          }
        } catch (const std::exception& e) {
          b.fail(e.what());
        }
        std::lock_guard<std::mutex> lock(b.mutex);
        if (--b.pending == 0) b.done_cv.notify_all();
      });
    }
    std::unique_lock<std::mutex> lock(batch->mutex);
    batch->done_cv.wait(lock, [&] { return batch->pending == 0; });
  }

#ifdef FLASHLLM_WITH_URING
  // One ring with `threads` reads in flight and one bounce buffer per slot; calls on the ring are serialized.
  // The buffers belong to the reader, so a ring that fails mid-batch can never write into freed memory. A read
  // longer than max_request_ is issued as several requests, one after another in its slot.
  void run_uring(Batch& b) {
    std::lock_guard<std::mutex> ring_lock(ring_mutex_);
    TORCH_CHECK(!ring_broken_, "FlashReader: the io_uring ring failed earlier; open a new reader");
    int64_t max_span = 0;
    for (const Read& r : b.reads) max_span = std::max(max_span, align_.up(r.offset + r.length) - align_.down(r.offset));
    // As many slots as the bounce limit holds buffers of the longest read (at least one); the ring's buffers are
    // dropped and made anew when the ones kept from earlier calls would exceed the limit.
    int64_t depth = std::min<int64_t>(threads_, b.reads.size());
    if (bounce_limit_ >= 0) depth = std::max<int64_t>(1, std::min(depth, bounce_limit_ / max_span));
    int64_t kept = 0;
    for (int64_t s = 0; s < static_cast<int64_t>(ring_buffers_.size()); ++s)
      kept += s < depth ? std::max(ring_buffers_[s].size, max_span) : ring_buffers_[s].size;
    if (bounce_limit_ >= 0 && kept > std::max(bounce_limit_, max_span)) ring_buffers_.clear();
    if (static_cast<int64_t>(ring_buffers_.size()) < depth) ring_buffers_.resize(depth);
    struct Slot {
      int64_t read = -1;
      int64_t got = 0;
      int stalls = 0;
    };
    std::vector<Slot> slots(depth);
    int64_t next = 0, in_flight = 0;
    auto submit = [&](int64_t s) {
      const Read& r = b.reads[slots[s].read];
      const int64_t start = align_.down(r.offset);
      const int64_t want = align_.up(r.offset + r.length) - start;
      const int64_t length = std::min(want - slots[s].got, max_request_);
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);  // never null: at most `depth` <= ring size in flight
      io_uring_prep_read(sqe, fd_, ring_buffers_[s].data + slots[s].got, static_cast<unsigned>(length),
                         start + slots[s].got);
      io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(s));
      ++in_flight;
    };
    for (int64_t s = 0; s < depth; ++s) {
      ring_buffers_[s].reserve(max_span, align_.memory);
      slots[s] = {next++, 0, 0};
      submit(s);
    }
    while (in_flight > 0) {
      const int rc = io_uring_submit_and_wait(&ring_, 1);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN) {
        ring_broken_ = true;
        b.fail(io_error("io_uring_submit_and_wait failed", -rc, 0, 0));
        return;
      }
      io_uring_cqe* cqe;
      while (io_uring_peek_cqe(&ring_, &cqe) == 0) {
        const int64_t s = static_cast<int64_t>(io_uring_cqe_get_data64(cqe));
        const int res = cqe->res;
        io_uring_cqe_seen(&ring_, cqe);
        --in_flight;
        Slot& slot = slots[s];
        const Read& r = b.reads[slot.read];
        const int64_t start = align_.down(r.offset);
        const int64_t need = r.offset + r.length - start;
        if (res == -EINTR || res == -EAGAIN) {
          submit(s);
          continue;
        }
        if (res < 0) {
          b.fail(io_error("io_uring read failed", -res, start + slot.got, need - slot.got));
        } else {
          const int64_t before = slot.got;
          slot.got += res;
          b.bytes_read += res;
          if (slot.got < need && direct_) slot.got = align_.down(slot.got);
          slot.stalls = slot.got > before ? 0 : slot.stalls + 1;  // as in read_span: only no-progress reads count
          if (res == 0 || slot.stalls > 16) {
            b.fail(io_error("unexpected end of file (file shorter than the store says?)", EIO, start + slot.got,
                            need - slot.got));
          } else if (slot.got < need) {
            submit(s);
            continue;
          } else {
            b.scatter(r, ring_buffers_[s].data, start);
          }
        }
        if (!b.failed.load() && next < static_cast<int64_t>(b.reads.size())) {
          slot = {next++, 0, 0};
          submit(s);
        }
      }
    }
  }
#else
  void run_uring(Batch&) { TORCH_CHECK(false, "FlashReader: built without io_uring"); }
#endif

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  int64_t threads_ = 0;
  DirectAlign align_;
  int64_t min_read_, max_gap_, max_read_;
  int64_t max_request_ = 0;  // io_uring: bytes of one request (max_read, aligned, at most kMaxUringRequest)
  int64_t bounce_limit_;
  BouncePool bounce_;
  std::string engine_;
  std::unique_ptr<ThreadPool> pool_;
#ifdef FLASHLLM_WITH_URING
  io_uring ring_;
  mutable std::mutex ring_mutex_;
  std::vector<AlignedBuffer> ring_buffers_;
  bool ring_broken_ = false;
#endif
};

bool has_io_uring() {
#ifdef FLASHLLM_WITH_URING
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(flashllm, m) {
  m.class_<FlashReader>("FlashReader")
      .def(torch::init<std::string, int64_t, int64_t, int64_t, int64_t, bool, std::string, int64_t>())
      .def("read_rows", &FlashReader::read_rows)
      .def("read_var_rows", &FlashReader::read_var_rows)
      .def("plan_reads", &FlashReader::plan_reads)
      .def("direct", &FlashReader::direct)
      .def("threads", &FlashReader::threads)
      .def("engine", &FlashReader::engine)
      .def("path", &FlashReader::path)
      .def("dio_offset_align", &FlashReader::dio_offset_align)
      .def("dio_mem_align", &FlashReader::dio_mem_align)
      .def("bounce_bytes", &FlashReader::bounce_bytes);
  m.def("reader_has_io_uring() -> bool", &has_io_uring);
}

}  // namespace flashllm::io
