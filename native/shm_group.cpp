#include "shm_group.h"

#include "pack.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace rtx {

bool reduce_op_from_name(const std::string &name, ReduceOp &out) {
    static const std::pair<const char *, ReduceOp> table[] = {
        {"sum", ReduceOp::Sum}, {"min", ReduceOp::Min}, {"max", ReduceOp::Max},
        {"product", ReduceOp::Product}, {"band", ReduceOp::BAnd}};
    for (const auto &[n, op] : table)
        if (name == n) { out = op; return true; }
    return false;
}

struct alignas(64) RankWord {
    std::atomic<std::uint32_t> seq;      // barriers this rank has arrived at
    std::atomic<std::uint32_t> waiters;  // peers sleeping on `seq`
    std::atomic<std::int32_t> pid;
};

struct alignas(64) ShmHeader {
    std::atomic<std::uint64_t> magic;
    std::atomic<std::uint32_t> aborted;
    std::uint32_t size;
    std::uint64_t slot_bytes;
};

namespace {

constexpr std::uint64_t kMagic = 0x7274782d73686d31ull;  // "rtx-shm1"
constexpr std::size_t kPage = 4096;
constexpr std::size_t kSplitBytes = 256 << 10;  // split chunks this large on > 2 ranks

static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "futex words must be lock-free");

RankWord *words_of(ShmHeader *h) { return reinterpret_cast<RankWord *>(h + 1); }

std::size_t header_bytes(int size) {
    const std::size_t raw = sizeof(ShmHeader) + sizeof(RankWord) * static_cast<std::size_t>(size);
    return (raw + kPage - 1) / kPage * kPage;
}

std::runtime_error sys_error(const std::string &what, int err) {
    return std::runtime_error(what + ": " + std::strerror(err));
}

long futex(std::atomic<std::uint32_t> *word, int op, std::uint32_t value,
           const struct timespec *timeout) {
    return syscall(SYS_futex, reinterpret_cast<std::uint32_t *>(word), op, value, timeout,
                   nullptr, 0);
}

bool reached(std::uint32_t value, std::uint32_t target) {
    return static_cast<std::int32_t>(value - target) >= 0;
}

bool process_alive(int pid) {
    if (pid <= 0) return true;  // not registered yet
    if (kill(pid, 0) == -1 && errno == ESRCH) return false;
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    FILE *f = std::fopen(path, "r");
    if (f == nullptr) return errno != ENOENT;
    char buf[512];
    const std::size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    const char *paren = std::strrchr(buf, ')');  // the command name may contain spaces
    if (paren == nullptr || paren[1] == '\0' || paren[2] == '\0') return true;
    const char state = paren[2];
    return state != 'Z' && state != 'X';  // a zombie has died but was not reaped yet
}

// --- element-wise combination: out = a (op) b, the same order on every rank -------------

template <typename T, bool Integral = std::is_integral_v<T>>
struct Arith {
    static T add(T a, T b) { return a + b; }
    static T mul(T a, T b) { return a * b; }
};

template <typename T>
struct Arith<T, true> {  // integers wrap around like gloo's (computed unsigned: no UB)
    using U = std::make_unsigned_t<T>;
    static T add(T a, T b) { return static_cast<T>(static_cast<U>(a) + static_cast<U>(b)); }
    static T mul(T a, T b) { return static_cast<T>(static_cast<U>(a) * static_cast<U>(b)); }
};

template <typename T>
void combine_native(T *out, const T *a, const T *b, std::size_t n, ReduceOp op) {
    switch (op) {
        case ReduceOp::Sum:
            for (std::size_t i = 0; i < n; ++i) out[i] = Arith<T>::add(a[i], b[i]);
            break;
        case ReduceOp::Product:
            for (std::size_t i = 0; i < n; ++i) out[i] = Arith<T>::mul(a[i], b[i]);
            break;
        // a NaN from either side wins (b != b: b is NaN; a NaN in a is kept by the compare)
        case ReduceOp::Min:
            for (std::size_t i = 0; i < n; ++i)
                out[i] = (b[i] < a[i] || b[i] != b[i]) ? b[i] : a[i];
            break;
        case ReduceOp::Max:
            for (std::size_t i = 0; i < n; ++i)
                out[i] = (a[i] < b[i] || b[i] != b[i]) ? b[i] : a[i];
            break;
        case ReduceOp::BAnd:
            if constexpr (std::is_integral_v<T>) {
                for (std::size_t i = 0; i < n; ++i) out[i] = a[i] & b[i];
            }
            break;
    }
}

// 16-bit floats: each step computed in float and rounded back, like two torch tensors added.
template <float (*ToF)(std::uint16_t), std::uint16_t (*FromF)(float)>
void combine16(std::uint16_t *out, const std::uint16_t *a, const std::uint16_t *b, std::size_t n,
               ReduceOp op) {
    for (std::size_t i = 0; i < n; ++i) {
        const float x = ToF(a[i]), y = ToF(b[i]);
        float r;
        switch (op) {
            case ReduceOp::Sum: r = x + y; break;
            case ReduceOp::Product: r = x * y; break;
            case ReduceOp::Min: r = (y < x || y != y) ? y : x; break;
            default: r = (x < y || y != y) ? y : x; break;
        }
        out[i] = FromF(r);
    }
}

template <typename T>
void combine_as(void *out, const void *a, const void *b, std::size_t n, ReduceOp op) {
    combine_native(static_cast<T *>(out), static_cast<const T *>(a), static_cast<const T *>(b),
                   n, op);
}

template <float (*ToF)(std::uint16_t), std::uint16_t (*FromF)(float)>
void combine16_as(void *out, const void *a, const void *b, std::size_t n, ReduceOp op) {
    combine16<ToF, FromF>(static_cast<std::uint16_t *>(out),
                          static_cast<const std::uint16_t *>(a),
                          static_cast<const std::uint16_t *>(b), n, op);
}

void combine(void *out, const void *a, const void *b, std::size_t n, DType dt, ReduceOp op) {
    switch (dt) {
        case DType::Float32: combine_as<float>(out, a, b, n, op); break;
        case DType::Float64: combine_as<double>(out, a, b, n, op); break;
        case DType::Int32: combine_as<std::int32_t>(out, a, b, n, op); break;
        case DType::Int64: combine_as<std::int64_t>(out, a, b, n, op); break;
        case DType::Int8: combine_as<std::int8_t>(out, a, b, n, op); break;
        case DType::UInt8: combine_as<std::uint8_t>(out, a, b, n, op); break;
        case DType::Float16: combine16_as<half_to_float, float_to_half>(out, a, b, n, op); break;
        case DType::BFloat16: combine16_as<bf16_to_float, float_to_bf16>(out, a, b, n, op); break;
    }
}

void check_op(DType dt, ReduceOp op) {
    if (op == ReduceOp::BAnd && is_floating(dt))
        throw std::invalid_argument("bitwise AND needs an integer dtype");
}

}  // namespace

ShmGroup::ShmGroup(const std::string &name, int rank, int size, std::size_t slot_bytes,
                   bool create, double timeout_s)
    : name_(name), rank_(rank), size_(size), slot_bytes_(slot_bytes), timeout_s_(timeout_s) {
    if (size < 1 || rank < 0 || rank >= size)
        throw std::invalid_argument("shm group: rank must be within [0, size)");
    if (slot_bytes == 0 || slot_bytes % 64 != 0)
        throw std::invalid_argument("shm group: slot_bytes must be a positive multiple of 64");
    const std::size_t head = header_bytes(size);
    mapped_bytes_ = head + 2 * static_cast<std::size_t>(size) * slot_bytes;
    const int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
    if (fd < 0) throw sys_error("shm_open(" + name + ")", errno);
    if (create) {
        owner_ = true;
        // Reserve the pages now: a full /dev/shm must fail here, not as SIGBUS on first touch.
        int err = ftruncate(fd, static_cast<off_t>(mapped_bytes_)) == 0 ? 0 : errno;
        if (err == 0) err = posix_fallocate(fd, 0, static_cast<off_t>(mapped_bytes_));
        if (err != 0) {
            close(fd);
            shm_unlink(name.c_str());
            throw sys_error("reserving " + std::to_string(mapped_bytes_) + " bytes of " + name, err);
        }
    } else {
        struct stat st {};
        if (fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != mapped_bytes_) {
            close(fd);
            throw std::runtime_error("shm segment " + name + " has an unexpected size");
        }
    }
    base_ = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int map_err = errno;
    close(fd);
    if (base_ == MAP_FAILED) {
        base_ = nullptr;
        if (create) shm_unlink(name.c_str());
        throw sys_error("mmap(" + name + ")", map_err);
    }
    header_ = static_cast<ShmHeader *>(base_);
    data_ = static_cast<char *>(base_) + head;
    if (create) {
        header_->size = static_cast<std::uint32_t>(size);
        header_->slot_bytes = slot_bytes;
        header_->magic.store(kMagic, std::memory_order_release);
    } else if (header_->magic.load(std::memory_order_acquire) != kMagic ||
               header_->size != static_cast<std::uint32_t>(size) ||
               header_->slot_bytes != slot_bytes) {
        munmap(base_, mapped_bytes_);
        base_ = nullptr;
        throw std::runtime_error("shm segment " + name + " was made for another group");
    }
    words_of(header_)[rank].pid.store(static_cast<std::int32_t>(getpid()));
}

ShmGroup::~ShmGroup() {
    if (base_ != nullptr) munmap(base_, mapped_bytes_);
    unlink();  // a creator dropped before the others mapped it: its name goes with it
}

void ShmGroup::unlink() {
    if (owner_) {
        shm_unlink(name_.c_str());
        owner_ = false;
    }
}

bool ShmGroup::peers_visible() const {
    for (int r = 0; r < size_; ++r) {
        const int pid = words_of(header_)[r].pid.load();
        if (pid <= 0 || kill(pid, 0) != 0) return false;
    }
    return true;
}

char *ShmGroup::slot(int set, int rank) const {
    return data_ + (static_cast<std::size_t>(set) * size_ + rank) * slot_bytes_;
}

void ShmGroup::combine_slots(void *out, int set, std::size_t at, std::size_t n, DType dt,
                             ReduceOp op) const {
    if (size_ == 1) {
        std::memcpy(out, slot(set, 0) + at, n * itemsize(dt));
        return;
    }
    combine(out, slot(set, 0) + at, slot(set, 1) + at, n, dt, op);
    for (int r = 2; r < size_; ++r) combine(out, out, slot(set, r) + at, n, dt, op);
}

void ShmGroup::abort() {
    header_->aborted.store(1, std::memory_order_seq_cst);
    for (int r = 0; r < size_; ++r) futex(&words_of(header_)[r].seq, FUTEX_WAKE, INT_MAX, nullptr);
}

void ShmGroup::check_peer(int peer) const {
    if (header_->aborted.load(std::memory_order_acquire))
        throw std::runtime_error("a peer on this host gave up (shared-memory group aborted)");
    if (!process_alive(words_of(header_)[peer].pid.load()))
        throw std::runtime_error("rank " + std::to_string(peer) +
                                 " of this host's shared-memory group has died");
}

void ShmGroup::barrier() {
    const std::uint32_t target = ++epoch_;
    RankWord &me = words_of(header_)[rank_];
    me.seq.store(target, std::memory_order_seq_cst);
    if (me.waiters.load(std::memory_order_seq_cst) != 0) futex(&me.seq, FUTEX_WAKE, INT_MAX, nullptr);
    for (int r = 0; r < size_; ++r)
        if (r != rank_) wait_for(r, target);
}

void ShmGroup::wait_for(int peer, std::uint32_t target) {
    RankWord &w = words_of(header_)[peer];
    for (int i = 0; i < 256; ++i) {
        if (reached(w.seq.load(std::memory_order_acquire), target)) return;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    auto next_check = start + std::chrono::milliseconds(100);
    const auto deadline = start + std::chrono::duration_cast<clock::duration>(
                                      std::chrono::duration<double>(timeout_s_));
    for (int yields = 0;; ) {
        std::uint32_t seen = w.seq.load(std::memory_order_acquire);
        if (reached(seen, target)) return;
        if (header_->aborted.load(std::memory_order_relaxed)) check_peer(peer);
        if (yields < 32) {  // a peer that is merely descheduled arrives within a few yields
            ++yields;
            sched_yield();
            continue;
        }
        w.waiters.fetch_add(1, std::memory_order_seq_cst);
        seen = w.seq.load(std::memory_order_seq_cst);
        if (!reached(seen, target)) {
            const struct timespec nap {0, 10 * 1000 * 1000};
            futex(&w.seq, FUTEX_WAIT, seen, &nap);
        }
        w.waiters.fetch_sub(1, std::memory_order_seq_cst);
        const auto now = clock::now();
        if (now >= next_check) {
            check_peer(peer);
            next_check = now + std::chrono::milliseconds(100);
        }
        if (now >= deadline)
            throw std::runtime_error("timed out after " + std::to_string(timeout_s_) +
                                     " s waiting for rank " + std::to_string(peer) +
                                     " of this host's shared-memory group");
    }
}

void ShmGroup::allreduce(void *data, std::size_t count, DType dt, ReduceOp op) {
    check_op(dt, op);
    if (size_ == 1 || count == 0) return;
    const std::size_t isz = itemsize(dt);
    const std::size_t per_chunk = slot_bytes_ / isz;
    char *bytes = static_cast<char *>(data);
    for (std::size_t off = 0; off < count; off += per_chunk) {
        const std::size_t m = std::min(per_chunk, count - off);
        const int set = static_cast<int>(chunks_++ & 1);
        char *mine = bytes + off * isz;
        std::memcpy(slot(set, rank_), mine, m * isz);
        barrier();
        if (size_ > 2 && m * isz >= kSplitBytes) {
            // Each rank combines its share (into its own output, then publishes it in its
            // slot); after the second barrier everyone copies the other shares out.
            const std::size_t lo = m * rank_ / size_, hi = m * (rank_ + 1) / size_;
            char *share = mine + lo * isz;
            combine_slots(share, set, lo * isz, hi - lo, dt, op);
            std::memcpy(slot(set, rank_) + lo * isz, share, (hi - lo) * isz);
            barrier();
            for (int r = 0; r < size_; ++r) {
                if (r == rank_) continue;
                const std::size_t rlo = m * r / size_, rhi = m * (r + 1) / size_;
                std::memcpy(mine + rlo * isz, slot(set, r) + rlo * isz, (rhi - rlo) * isz);
            }
        } else {
            combine_slots(mine, set, 0, m, dt, op);
        }
    }
}

void ShmGroup::allreduce_many(const std::vector<Piece> &pieces, DType dt, ReduceOp op,
                              double prescale, double postscale) {
    check_op(dt, op);
    if ((prescale != 1.0 || postscale != 1.0) && !is_floating(dt))
        throw std::invalid_argument("scaling needs a floating dtype");
    std::size_t total = 0;
    for (const Piece &p : pieces) total += p.count;
    if (total == 0) return;
    const std::size_t isz = itemsize(dt);
    const std::size_t per_chunk = slot_bytes_ / isz;
    // Walks the pieces as one array: calls fn(piece pointer, offset in the chunk, count).
    struct Cursor {
        std::size_t piece = 0, offset = 0;
    };
    auto walk = [&](Cursor &c, std::size_t m, auto &&fn) {
        for (std::size_t done = 0; done < m;) {
            while (pieces[c.piece].count == c.offset) {
                ++c.piece;
                c.offset = 0;
            }
            const std::size_t take = std::min(m - done, pieces[c.piece].count - c.offset);
            fn(static_cast<char *>(pieces[c.piece].data) + c.offset * isz, done, take);
            done += take;
            c.offset += take;
        }
    };
    std::vector<Segment> segs;
    Cursor fill, drain;
    for (std::size_t off = 0; off < total; off += per_chunk) {
        const std::size_t m = std::min(per_chunk, total - off);
        const int set = static_cast<int>(chunks_++ & 1);
        char *mine = slot(set, rank_);
        segs.clear();
        walk(fill, m, [&](char *p, std::size_t at, std::size_t n) {
            segs.push_back({p, mine + at * isz, n});
        });
        copy_segments(segs, dt, dt, prescale, 1);
        barrier();
        segs.clear();
        walk(drain, m, [&](char *p, std::size_t at, std::size_t n) {
            combine_slots(p, set, at * isz, n, dt, op);
            if (postscale != 1.0) segs.push_back({p, p, n});
        });
        if (!segs.empty()) copy_segments(segs, dt, dt, postscale, 1);
    }
}

void ShmGroup::reduce_scatter(const void *input, void *output, std::size_t count, DType dt,
                              ReduceOp op) {
    check_op(dt, op);
    if (count % static_cast<std::size_t>(size_) != 0)
        throw std::invalid_argument("reduce_scatter: " + std::to_string(count) +
                                    " elements do not split into " + std::to_string(size_) +
                                    " equal shares");
    const std::size_t isz = itemsize(dt);
    const std::size_t share = count / size_;
    const char *src = static_cast<const char *>(input);
    char *dst = static_cast<char *>(output);
    if (size_ == 1) {
        if (dst != src) std::memcpy(dst, src, count * isz);
        return;
    }
    // Each chunk takes the same stretch of every share: a member writes its stretches side by
    // side in its slot, and after the barrier reduces the members' stretches of its own share.
    // A slot is written again two chunks later, after a barrier every reader has passed.
    const std::size_t per_chunk = std::max<std::size_t>(1, slot_bytes_ / isz / size_);
    for (std::size_t off = 0; off < share; off += per_chunk) {
        const std::size_t m = std::min(per_chunk, share - off);
        const int set = static_cast<int>(chunks_++ & 1);
        char *mine = slot(set, rank_);
        for (int r = 0; r < size_; ++r)
            std::memcpy(mine + r * m * isz, src + (r * share + off) * isz, m * isz);
        barrier();
        combine_slots(dst + off * isz, set, rank_ * m * isz, m, dt, op);
    }
}

void ShmGroup::allgather_shards(void *data, std::size_t count, DType dt) {
    if (size_ == 1 || count == 0) return;
    const std::size_t isz = itemsize(dt);
    const std::size_t per_chunk = slot_bytes_ / isz;
    const std::size_t longest = (count + size_ - 1) / size_;
    char *bytes = static_cast<char *>(data);
    auto shard = [&](int r) { return std::make_pair(count * r / size_, count * (r + 1) / size_); };
    for (std::size_t off = 0; off < longest; off += per_chunk) {
        const int set = static_cast<int>(chunks_++ & 1);
        const auto [lo, hi] = shard(rank_);
        if (lo + off < hi)
            std::memcpy(slot(set, rank_), bytes + (lo + off) * isz,
                        std::min(per_chunk, hi - lo - off) * isz);
        barrier();
        for (int r = 0; r < size_; ++r) {
            const auto [rlo, rhi] = shard(r);
            if (r == rank_ || rlo + off >= rhi) continue;
            std::memcpy(bytes + (rlo + off) * isz, slot(set, r),
                        std::min(per_chunk, rhi - rlo - off) * isz);
        }
    }
}

}  // namespace rtx
