// GET /metrics on gradwatchd's HTTP listener (server/web/server.h): the text the collectors render
// straight into an Exposition, gzip-compressed when the client accepts it (Prometheus does). Also
// exposes what prometheus-cpp's Exposer did about itself: exposer_scrapes_total,
// exposer_transferred_bytes_total and exposer_request_latencies (microseconds), first in the text.
//
// Thread safety: scrapes arrive on the listener's I/O threads. Rendering runs one scrape at a time
// (collectors may keep caches from one scrape to the next, and two renders at once would only
// share the same two cores); compressing and writing to the client run in parallel. Each scrape
// renders into buffers kept from an earlier one, so a warm endpoint allocates nothing for the text
// (about 480 bytes a series at 100,000 series).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/registry.h>
#include <prometheus/summary.h>

#include "server/core/thread_annotations.h"
#include "server/export/exposition.h"
#include "server/web/server.h"

namespace gradwatch::exporter {

// Room for a compressed scrape, kept from one scrape to the next.
struct GzipBuffer {
  std::unique_ptr<char[]> data;
  size_t capacity = 0;
  size_t size = 0;  // bytes used
};

class MetricsEndpoint {
 public:
  // Appends a part of the scrape's text (one or more chunks of whole families).
  using Renderer = std::function<void(Exposition&)>;

  // Each scrape runs `renderers` in order; they must outlive the endpoint's responses.
  explicit MetricsEndpoint(std::vector<Renderer> renderers);

  // Must outlive the responses it gave (their bodies are its buffers).
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // Answers GET /metrics. The scrape is counted, timed and its bytes added once the response has
  // been written (when the listener releases it).
  web::Response Handle(const web::Request& request) EXCLUDES(render_mu_, pool_mu_);

 private:
  // A scrape's buffers: the text and its compressed form.
  struct Buffers {
    Exposition text;
    GzipBuffer gzip;
  };

  std::unique_ptr<Buffers> TakeBuffers() EXCLUDES(pool_mu_);
  void GiveBack(std::unique_ptr<Buffers> buffers) EXCLUDES(pool_mu_);

  const std::vector<Renderer> renderers_;

  Mutex render_mu_;  // held through a render: one at a time (never with pool_mu_)
  Mutex pool_mu_;
  std::vector<std::unique_ptr<Buffers>> pool_ GUARDED_BY(pool_mu_);  // at most one kept idle

  // The endpoint's own metrics (prometheus-cpp's Exposer's, same names and help).
  std::shared_ptr<prometheus::Registry> own_registry_;
  prometheus::Counter* transferred_bytes_ = nullptr;
  prometheus::Counter* scrapes_ = nullptr;
  prometheus::Summary* latencies_us_ = nullptr;
};

}  // namespace gradwatch::exporter
