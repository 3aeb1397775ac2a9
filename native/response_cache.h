// Fixed-capacity LRU of agreed tensor descriptions with stable slots, so that ranks can
// exchange which names they hold as a bit vector instead of full descriptions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace rtx {

struct CacheEntry {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    std::string op;
    int64_t slot = -1;
};

class ResponseCache {
public:
    explicit ResponseCache(std::size_t capacity);

    std::size_t capacity() const { return capacity_; }
    std::size_t size() const { return by_name_.size(); }

    // Stores (or refreshes) an entry and returns its slot; evicts the least recently used
    // entry when full. Returns -1 when the cache is disabled (capacity 0).
    int64_t put(const std::string &name, const std::string &dtype,
                const std::vector<int64_t> &shape, const std::string &op);
    // Looks up a name and marks it most recently used.
    std::optional<CacheEntry> get(const std::string &name);
    // Looks up a name without touching the LRU order.
    const CacheEntry *peek(const std::string &name) const;
    bool erase(const std::string &name);
    void clear();

    // One bit per slot, set for every name in `names` that is cached (64 slots per word).
    std::vector<uint64_t> bits(const std::vector<std::string> &names) const;
    // Entries whose slot bit is set, in slot order: the same order on every rank.
    std::vector<CacheEntry> entries_for_bits(const std::vector<uint64_t> &bits) const;
    // The names of `entries_for_bits(bits)`, in the same order.
    std::vector<std::string> names_for_bits(const std::vector<uint64_t> &bits) const;
    // Marks the entries whose slot bit is set most recently used, in slot order: the same
    // LRU order as `get` of each of `entries_for_bits(bits)` in turn.
    void touch_bits(const std::vector<uint64_t> &bits);
    std::size_t words() const { return (capacity_ + 63) / 64; }
    // Names from least to most recently used.
    std::vector<std::string> lru_order() const;

private:
    // Calls `fn(slot)` for each set bit whose slot holds an entry, in slot order.
    template <class Fn>
    void for_each_slot(const std::vector<uint64_t> &bits, Fn fn) const {
        const std::size_t n = std::min(bits.size(), words());
        for (std::size_t w = 0; w < n; ++w) {
            uint64_t word = bits[w];
            while (word != 0) {
                const int bit = __builtin_ctzll(word);
                word &= word - 1;
                const std::size_t slot = w * 64 + static_cast<std::size_t>(bit);
                if (slot < capacity_ && slots_[slot]) fn(slot);
            }
        }
    }

    std::size_t capacity_;
    std::list<int64_t> lru_;  // slots, front = least recently used
    std::vector<std::optional<CacheEntry>> slots_;
    std::vector<std::list<int64_t>::iterator> lru_pos_;
    std::unordered_map<std::string, int64_t> by_name_;
    std::vector<int64_t> free_slots_;
};

}  // namespace rtx
