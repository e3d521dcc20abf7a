#include "persist/version_table.h"

#include <algorithm>

namespace nebulite {

std::shared_ptr<VersionState> VersionTable::Find(const std::string& tag,
                                                 const std::string& version) const {
  for (auto& v : versions_)
    if (v->tag == tag && v->version == version) return v;
  return nullptr;
}

std::shared_ptr<VersionState> VersionTable::GetOrCreate(const std::string& tag,
                                                        const std::string& version) {
  auto v = Find(tag, version);
  if (v) return v;
  v = std::make_shared<VersionState>();
  v->tag = tag;
  v->version = version;
  versions_.push_back(v);
  return v;
}

void VersionTable::Release(ObjectState* o) {
  if (o->in_memory) {
    arena_->Release(o->block);
    o->in_memory = false;
    o->block = {};
  }
}

bool VersionTable::Evictable(const VersionState& v, const VersionState* newest) const {
  if (!v.committed || v.evicted || v.pins > 0) return false;
  if (v.persist_requested && !v.persisted && !v.failed) return false;
  if (&v == newest && !v.persisted) return false;
  for (const auto& o : v.objects)
    if (o->queued || !o->sealed) return false;
  return true;
}

const VersionState* VersionTable::NewestCommitted() const {
  const VersionState* n = nullptr;
  for (auto& v : versions_)
    if (v->committed && (!n || v->seq > n->seq)) n = v.get();
  return n && n->seq > forgotten_durable_seq_ ? n : nullptr;
}

bool VersionTable::EvictOldest(bool durable_only) {
  const VersionState* newest = NewestCommitted();
  std::shared_ptr<VersionState> victim;
  for (auto& v : versions_)
    if (Evictable(*v, newest) && (!durable_only || v->persisted) &&
        (!victim || v->seq < victim->seq))
      victim = v;
  if (!victim) return false;
  for (auto& o : victim->objects) Release(o.get());
  victim->evicted = true;
  Collect();
  return true;
}

uint64_t VersionTable::Reclaimable() const {
  const VersionState* newest = NewestCommitted();
  uint64_t bytes = 0;
  for (const auto& v : versions_) {
    if (!v->committed || v->evicted) continue;
    if (v.get() == newest && !v->persisted && !(v->persist_requested && !v->failed)) continue;
    for (const auto& o : v->objects)
      if (o->in_memory) bytes += o->block.size;
  }
  return bytes;
}

void VersionTable::Collect() {
  versions_.remove_if([this](const std::shared_ptr<VersionState>& v) {
    const bool forget = v->evicted && v->pins == 0 && !v->PendingInStore();
    if (forget && v->store_committed)
      forgotten_durable_seq_ = std::max(forgotten_durable_seq_, v->seq);
    return forget;
  });
}

void VersionTable::ApplyRetention() {
  Collect();
  if (retention_ == 0) return;
  while (true) {
    size_t held = 0;
    for (auto& v : versions_)
      if (v->committed && !v->evicted) ++held;
    if (held <= retention_ || !EvictOldest(false)) return;
  }
}

}  // namespace nebulite
