// Serves GET /metrics over HTTP/1.1 on civetweb (the server prometheus-cpp's Exposer runs on),
// from text the collectors render straight into an Exposition, gzip-compressed when the client
// accepts it (Prometheus does). Also exposes what the Exposer did about itself:
// exposer_scrapes_total, exposer_transferred_bytes_total and exposer_request_latencies
// (microseconds), first in the text as before.
//
// Thread safety: scrapes arrive on civetweb's request threads. Rendering runs one scrape at a
// time (collectors may keep caches from one scrape to the next, and two renders at once would
// only share the same two cores); compressing and writing to the client run in parallel. Each
// scrape renders into buffers kept from an earlier one, so a warm server allocates nothing for
// the text (about 480 bytes a series at 100,000 series).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/registry.h>
#include <prometheus/summary.h>

#include "server/core/status.h"
#include "server/core/thread_annotations.h"
#include "server/export/exposition.h"

struct mg_connection;
struct mg_context;

namespace gradwatch::exporter {

// Room for a compressed scrape, kept from one scrape to the next.
struct GzipBuffer {
  std::unique_ptr<char[]> data;
  size_t capacity = 0;
  size_t size = 0;  // bytes used
};

class MetricsServer {
 public:
  // Appends a part of the scrape's text (one or more chunks of whole families).
  using Renderer = std::function<void(Exposition&)>;
  // Decides from a request's Authorization header (null when absent) whether it may scrape:
  // 200, or 401 / 403 with the message for the body.
  using Gate = std::function<std::pair<int, std::string>(const char* authorization)>;

  // Listens on `listen` (HOST:PORT; port 0: any free port) with `threads` request threads. Each
  // scrape passes `gate` (when set) and runs `renderers` in order; they must outlive the server.
  static StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen, std::vector<Renderer> renderers,
                                                        int threads = 2, Gate gate = {});

  // Stops listening and waits for the scrapes in progress.
  ~MetricsServer();

  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The port listened on (the one chosen when `listen` asked for port 0).
  int port() const { return port_; }

 private:
  // A scrape's buffers: the text and its compressed form.
  struct Buffers {
    Exposition text;
    GzipBuffer gzip;
  };

  explicit MetricsServer(std::vector<Renderer> renderers);

  static int HandleRequest(mg_connection* conn, void* self);
  void Serve(mg_connection* conn) EXCLUDES(render_mu_, pool_mu_);
  std::unique_ptr<Buffers> TakeBuffers() EXCLUDES(pool_mu_);
  void GiveBack(std::unique_ptr<Buffers> buffers) EXCLUDES(pool_mu_);

  const std::vector<Renderer> renderers_;
  Gate gate_;
  mg_context* ctx_ = nullptr;
  int port_ = 0;

  Mutex render_mu_;  // held through a render: one at a time (never with pool_mu_)
  Mutex pool_mu_;
  std::vector<std::unique_ptr<Buffers>> pool_ GUARDED_BY(pool_mu_);  // at most one kept idle

  // The server's own metrics (prometheus-cpp's Exposer's, same names and help).
  std::shared_ptr<prometheus::Registry> own_registry_;
  prometheus::Counter* transferred_bytes_ = nullptr;
  prometheus::Counter* scrapes_ = nullptr;
  prometheus::Summary* latencies_us_ = nullptr;
};

}  // namespace gradwatch::exporter
