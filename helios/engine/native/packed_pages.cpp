// Packed pages: a copy of each full page of a bfloat16 KV cache in the layout tiles_in_place reads
// (attention_tiles.cpp: per kv head and 16-key block, keys as pairs of features x 16 keys, values as
// pairs of keys x 16 features), kept for the caches whose owner asks for it (keep_packed).
//
// Decode attention otherwise packs every tile of a sequence's history at every step: the history is
// read as 128-byte rows scattered over its pages and turned around in registers, layer after layer,
// which on a 2-core Zen 4 cost 80 % of a 16-row step's attention. A page's packed copy is made the
// first time a step reads the page full and used until the page is written again: every write to
// a kept cache's pages goes through write_kv (which marks the pages it touches stale) or is
// announced with forget_packed (pages filled from the host store, copied pages). The packed bytes
// are the ones the tile kernel would have packed, so a row's result is bit-identical either way.
//
// The copy is as large as the cache; its memory is touched page by page as pages are first packed.
#include <memory>
#include <mutex>
#include <unordered_map>

#include "common.h"

namespace flare_native {

namespace {

std::mutex registry_mutex;
// Kept caches by their keys' data pointer; each entry checks the storage it was made for.
std::unordered_map<const void*, std::shared_ptr<PackedPages>> registry;
std::atomic<int64_t> kept{0};  // registry.size(), read without the lock by write_kv

bool same_storage(const PackedPages& p, const at::Tensor& k_cache) {
  const auto held = p.storage.lock();
  return held.get() == k_cache.storage().unsafeGetStorageImpl() && p.pages == k_cache.size(0) &&
         p.page_tokens == k_cache.size(1) && p.kv_heads == k_cache.size(2) && p.dim == k_cache.size(3);
}

// Entries whose cache has been freed (its storage expired) go; caller holds the lock.
void sweep() {
  for (auto it = registry.begin(); it != registry.end();) it = it->second->storage.expired() ? registry.erase(it) : ++it;
  kept.store(static_cast<int64_t>(registry.size()), std::memory_order_relaxed);
}

// The layouts tiles_in_place reads whose pages hold whole 16-key blocks.
[[maybe_unused]] bool packed_pages_supported(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  return k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == at::kBFloat16 &&
         v_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
         k_cache.device().is_cpu() && k_cache.size(1) % kBlock == 0 && k_cache.size(3) % 64 == 0 &&
         k_cache.size(3) <= 256;
}

}  // namespace

bool keep_packed(const at::Tensor& k_cache, const at::Tensor& v_cache) {
#if defined(__AVX512BF16__)
  if (!packed_pages_supported(k_cache, v_cache)) return false;
  std::lock_guard<std::mutex> lock(registry_mutex);
  sweep();
  auto& slot = registry[k_cache.data_ptr()];
  if (slot != nullptr && same_storage(*slot, k_cache) &&
      slot->v_storage.lock().get() == v_cache.storage().unsafeGetStorageImpl())
    return true;
  auto p = std::make_shared<PackedPages>();
  p->storage = k_cache.storage().getWeakStorageImpl();
  p->v_storage = v_cache.storage().getWeakStorageImpl();
  p->pages = k_cache.size(0);
  p->page_tokens = k_cache.size(1);
  p->kv_heads = k_cache.size(2);
  p->dim = k_cache.size(3);
  p->k = at::empty(k_cache.sizes(), k_cache.options());
  p->v = at::empty(v_cache.sizes(), v_cache.options());
  p->state = std::make_unique<std::atomic<uint8_t>[]>(p->pages * p->kv_heads);
  for (int64_t i = 0; i < p->pages * p->kv_heads; ++i) p->state[i].store(PackedPages::kStale);
  slot = std::move(p);
  kept.store(static_cast<int64_t>(registry.size()), std::memory_order_relaxed);
  return true;
#else
  return false;
#endif
}

std::shared_ptr<PackedPages> packed_pages_of(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  if (kept.load(std::memory_order_relaxed) == 0) return nullptr;
  std::lock_guard<std::mutex> lock(registry_mutex);
  const auto it = registry.find(k_cache.data_ptr());
  if (it == registry.end() || !same_storage(*it->second, k_cache) ||
      it->second->v_storage.lock().get() != v_cache.storage().unsafeGetStorageImpl())
    return nullptr;
  return it->second;
}

void forget_pages(const at::Tensor& k_cache, const int64_t* pages, int64_t n, int64_t divisor) {
  if (kept.load(std::memory_order_relaxed) == 0) return;
  std::shared_ptr<PackedPages> p;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    const auto it = registry.find(k_cache.data_ptr());
    if (it == registry.end()) return;
    p = it->second;
  }
  // A write through a tensor over the same memory (a wider view of the pool) marks the same pages.
  for (int64_t i = 0; i < n; ++i) {
    if (pages[i] < 0) continue;
    const int64_t page = pages[i] / divisor;
    if (page >= p->pages) continue;
    for (int64_t h = 0; h < p->kv_heads; ++h) p->state[page * p->kv_heads + h].store(PackedPages::kStale);
  }
}

void forget_packed(const at::Tensor& k_cache, const at::Tensor& pages) {
  const at::Tensor index = pages.to(at::kLong).contiguous();
  forget_pages(k_cache, index.data_ptr<int64_t>(), index.numel(), 1);
}

}  // namespace flare_native
