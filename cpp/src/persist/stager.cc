#include "persist/stager.h"

#include "nebulite/data_file_writer.h"

namespace nebulite {

void Stager::EnqueueLocked(std::shared_ptr<VersionState> v, ObjectState* o,
                           std::vector<CopySpan> spans, std::vector<size_t> records) {
  o->sealed = false;
  ++v->pins;  // released once the copy has landed
  queue_.push_back({std::move(v), o, std::move(spans), std::move(records)});
  core_->changed.notify_all();
}

void Stager::WaitIdle() {
  std::unique_lock<std::mutex> lock(core_->mu);
  core_->changed.wait(lock, [&] { return IdleLocked(); });
}

void Stager::Loop() {
  std::unique_lock<std::mutex> lock(core_->mu);
  while (true) {
    core_->changed.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopped and drained
    Job job = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    std::vector<uint32_t> crcs;
    core_->copy.CopyWithCrc(job.spans, &crcs);
    lock.lock();
    ObjectState* o = job.object;
    for (size_t k = 0; k < job.records.size(); ++k) o->crcs[job.records[k]] = crcs[k];
    if (o->in_memory) {
      Result<uint32_t> file_crc =
          FinishImage(o->layout, core_->arena->base() + o->block.offset, o->crcs);
      o->file = {o->name, o->bytes, file_crc.ok() ? *file_crc : 0};
    }
    o->sealed = true;
    busy_ = false;
    --job.version->pins;
    if (job.version->abandoned && !o->queued) core_->versions.Release(o);
    core_->changed.notify_all();
  }
}

}  // namespace nebulite
