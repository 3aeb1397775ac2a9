#include "response_cache.h"

namespace rtx {

ResponseCache::ResponseCache(std::size_t capacity)
    : capacity_(capacity), slots_(capacity), lru_pos_(capacity) {
    free_slots_.reserve(capacity);
    for (std::size_t i = capacity; i > 0; --i) free_slots_.push_back(static_cast<int64_t>(i - 1));
}

int64_t ResponseCache::put(const std::string &name, const std::string &dtype,
                           const std::vector<int64_t> &shape, const std::string &op) {
    if (capacity_ == 0) return -1;
    int64_t slot;
    auto found = by_name_.find(name);
    if (found != by_name_.end()) {
        slot = found->second;
        lru_.erase(lru_pos_[slot]);
    } else if (!free_slots_.empty()) {
        slot = free_slots_.back();
        free_slots_.pop_back();
    } else {
        slot = lru_.front();
        lru_.pop_front();
        by_name_.erase(slots_[slot]->name);
    }
    slots_[slot] = CacheEntry{name, dtype, shape, op, slot};
    by_name_[name] = slot;
    lru_pos_[slot] = lru_.insert(lru_.end(), slot);
    return slot;
}

std::optional<CacheEntry> ResponseCache::get(const std::string &name) {
    auto found = by_name_.find(name);
    if (found == by_name_.end()) return std::nullopt;
    const int64_t slot = found->second;
    lru_.splice(lru_.end(), lru_, lru_pos_[slot]);
    return slots_[slot];
}

const CacheEntry *ResponseCache::peek(const std::string &name) const {
    auto found = by_name_.find(name);
    return found == by_name_.end() ? nullptr : &*slots_[found->second];
}

bool ResponseCache::erase(const std::string &name) {
    auto found = by_name_.find(name);
    if (found == by_name_.end()) return false;
    const int64_t slot = found->second;
    lru_.erase(lru_pos_[slot]);
    slots_[slot].reset();
    free_slots_.push_back(slot);
    by_name_.erase(found);
    return true;
}

void ResponseCache::clear() {
    lru_.clear();
    by_name_.clear();
    free_slots_.clear();
    for (std::size_t i = capacity_; i > 0; --i) {
        slots_[i - 1].reset();
        free_slots_.push_back(static_cast<int64_t>(i - 1));
    }
}

std::vector<uint64_t> ResponseCache::bits(const std::vector<std::string> &names) const {
    std::vector<uint64_t> out(words(), 0);
    for (const std::string &name : names) {
        auto found = by_name_.find(name);
        if (found != by_name_.end())
            out[found->second / 64] |= uint64_t{1} << (found->second % 64);
    }
    return out;
}

std::vector<CacheEntry> ResponseCache::entries_for_bits(const std::vector<uint64_t> &bits) const {
    std::vector<CacheEntry> out;
    for_each_slot(bits, [&](std::size_t slot) { out.push_back(*slots_[slot]); });
    return out;
}

std::vector<std::string> ResponseCache::names_for_bits(const std::vector<uint64_t> &bits) const {
    std::vector<std::string> out;
    for_each_slot(bits, [&](std::size_t slot) { out.push_back(slots_[slot]->name); });
    return out;
}

void ResponseCache::touch_bits(const std::vector<uint64_t> &bits) {
    for_each_slot(bits, [&](std::size_t slot) { lru_.splice(lru_.end(), lru_, lru_pos_[slot]); });
}

std::vector<std::string> ResponseCache::lru_order() const {
    std::vector<std::string> out;
    out.reserve(lru_.size());
    for (int64_t slot : lru_) out.push_back(slots_[slot]->name);
    return out;
}

}  // namespace rtx
