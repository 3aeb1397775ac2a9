// Allreduce among the processes of one host through a POSIX shared-memory segment.
//
// Every member maps the same segment: a header with one sequence word per rank, then two
// sets of per-rank staging slots (chunks alternate between the sets, so one barrier per
// chunk is enough: nobody rewrites a set before every rank has finished reading it).
// A chunk is copied into the caller's slot, the ranks meet, and each rank combines the
// slots in rank order (so every rank computes bit-identical results). Large chunks on
// more than two ranks are split: each rank combines its share in place and the others
// copy it out after a second barrier. Waits spin briefly, then sleep on a futex; a wait
// fails after the timeout, when a peer process has died, or when a peer called abort().
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dtypes.h"

namespace rtx {

enum class ReduceOp : int { Sum, Min, Max, Product, BAnd };

// Returns false when the name is not a supported operation.
bool reduce_op_from_name(const std::string &name, ReduceOp &out);

struct ShmHeader;

class ShmGroup {
public:
    // Rank 0 creates the segment (`create`), the others open it afterwards. Throws
    // std::runtime_error when the segment cannot be created, reserved or mapped.
    ShmGroup(const std::string &name, int rank, int size, std::size_t slot_bytes, bool create,
             double timeout_s);
    ~ShmGroup();
    ShmGroup(const ShmGroup &) = delete;
    ShmGroup &operator=(const ShmGroup &) = delete;

    // Removes the segment's name; mappings stay valid. Call once every rank has opened it.
    void unlink();

    // True when every member's process is visible from here (same PID namespace).
    bool peers_visible() const;

    // In-place allreduce of `count` elements at `data`; collective over all members.
    // Throws std::runtime_error on timeout, a dead peer or an aborted group.
    void allreduce(void *data, std::size_t count, DType dtype, ReduceOp op);

    // One allreduce over several arrays of one dtype, as if they were back to back: the
    // chunks are filled straight from the arrays (times `prescale`) and the sums written
    // straight back (times `postscale`), so fusing costs no copies beyond the slots.
    struct Piece {
        void *data;
        std::size_t count;  // elements
    };
    void allreduce_many(const std::vector<Piece> &pieces, DType dtype, ReduceOp op,
                        double prescale, double postscale);

    // Shares shards in place: member r owns elements [count*r/size, count*(r+1)/size) of
    // `data`; afterwards every member holds every shard. Collective over all members.
    void allgather_shards(void *data, std::size_t count, DType dtype);
    // `input` (count elements) in size() equal shares: `output` (count / size() elements)
    // gets the reduction of every member's share rank(). count must divide evenly.
    void reduce_scatter(const void *input, void *output, std::size_t count, DType dtype,
                        ReduceOp op);

    // Makes every member's current and future waits fail (call when this rank gives up).
    void abort();

    int rank() const { return rank_; }
    int size() const { return size_; }
    std::size_t slot_bytes() const { return slot_bytes_; }
    std::uint64_t barriers() const { return epoch_; }

private:
    char *slot(int set, int rank) const;
    // out[0, n) = every member's slot of `set` from byte `at`, combined in rank order.
    void combine_slots(void *out, int set, std::size_t at, std::size_t n, DType dt,
                       ReduceOp op) const;
    void barrier();
    void wait_for(int peer, std::uint32_t target);
    void check_peer(int peer) const;

    std::string name_;
    int rank_;
    int size_;
    std::size_t slot_bytes_;
    double timeout_s_;
    std::size_t mapped_bytes_ = 0;
    void *base_ = nullptr;
    ShmHeader *header_ = nullptr;
    char *data_ = nullptr;
    std::uint32_t epoch_ = 0;
    std::uint64_t chunks_ = 0;
    bool owner_ = false;
};

}  // namespace rtx
