#include "server/export/metrics_server.h"

#include <chrono>
#include <cstring>
#include <string_view>

#include <civetweb.h>
#include <spdlog/spdlog.h>
#include <zlib.h>

#include "server/export/text_format.h"

namespace gradwatch::exporter {

namespace {

// Prometheus' Go client names this content type for text format 0.0.4.
constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// Whether the request's Accept-Encoding names gzip (Prometheus sends "gzip").
bool AcceptsGzip(mg_connection* conn) {
  const char* accepted = mg_get_header(conn, "Accept-Encoding");
  return accepted != nullptr && std::strstr(accepted, "gzip") != nullptr;
}

// Compresses the exposition's chunks in order into `out` as one gzip stream, at zlib's fastest
// level: at 100,000 series the text is about 48 MB, and the default level would take longer
// than rendering it. Returns false (out unspecified) when zlib fails.
bool Gzip(const Exposition& text, GzipBuffer& out) {
  z_stream zs{};
  constexpr int kGzipWindowBits = 16 + MAX_WBITS;  // 16: a gzip header and trailer
  constexpr int kMemLevel = 8;
  if (deflateInit2(&zs, Z_BEST_SPEED, Z_DEFLATED, kGzipWindowBits, kMemLevel, Z_DEFAULT_STRATEGY) != Z_OK) {
    return false;
  }
  const size_t bound = deflateBound(&zs, static_cast<uLong>(text.size()));
  if (out.capacity < bound) {
    out.data.reset(new char[bound]);  // not value-initialised: deflate writes what is sent
    out.capacity = bound;
  }
  zs.next_out = reinterpret_cast<Bytef*>(out.data.get());
  zs.avail_out = static_cast<uInt>(bound);
  int rc = Z_OK;
  const size_t chunks = text.chunk_count();
  for (size_t i = 0; i < chunks && rc == Z_OK; ++i) {
    const std::string& chunk = text.chunk(i);
    const bool last = i + 1 == chunks;
    if (chunk.empty() && !last) continue;  // deflate makes no progress on it (Z_BUF_ERROR)
    zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(chunk.data()));
    zs.avail_in = static_cast<uInt>(chunk.size());
    rc = deflate(&zs, last ? Z_FINISH : Z_NO_FLUSH);  // one call: the output has deflateBound's room
  }
  if (chunks == 0) rc = deflate(&zs, Z_FINISH);
  out.size = zs.total_out;
  deflateEnd(&zs);
  return rc == Z_STREAM_END;
}

int LogMessage(const mg_connection*, const char* message) {
  spdlog::warn("/metrics HTTP server: {}", message);
  return 1;  // logged: civetweb need not print it
}

}  // namespace

MetricsServer::MetricsServer(std::vector<Renderer> renderers)
    : renderers_(std::move(renderers)), own_registry_(std::make_shared<prometheus::Registry>()) {
  transferred_bytes_ = &prometheus::BuildCounter()
                            .Name("exposer_transferred_bytes_total")
                            .Help("Transferred bytes to metrics services")
                            .Register(*own_registry_)
                            .Add({});
  scrapes_ = &prometheus::BuildCounter()
                  .Name("exposer_scrapes_total")
                  .Help("Number of times metrics were scraped")
                  .Register(*own_registry_)
                  .Add({});
  latencies_us_ = &prometheus::BuildSummary()
                       .Name("exposer_request_latencies")
                       .Help("Latencies of serving scrape requests, in microseconds")
                       .Register(*own_registry_)
                       .Add({}, prometheus::Summary::Quantiles{{0.5, 0.05}, {0.9, 0.01}, {0.99, 0.001}});
}

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& listen,
                                                              std::vector<Renderer> renderers, int threads,
                                                              Gate gate) {
  std::unique_ptr<MetricsServer> server(new MetricsServer(std::move(renderers)));
  server->gate_ = std::move(gate);
  const std::string thread_count = std::to_string(threads);
  const char* options[] = {"listening_ports", listen.c_str(), "num_threads", thread_count.c_str(), nullptr};
  mg_callbacks callbacks{};
  callbacks.log_message = LogMessage;
  mg_init_data init{};
  init.callbacks = &callbacks;
  init.user_data = server.get();
  init.configuration_options = options;
  char error_text[256] = {0};
  unsigned error_code = 0;
  mg_error_data error{};
  error.code = &error_code;
  error.text = error_text;
  error.text_buffer_size = sizeof(error_text);
  server->ctx_ = mg_start2(&init, &error);
  if (server->ctx_ == nullptr) {
    return Status::Unavailable(error_text[0] != '\0' ? std::string(error_text) : "civetweb could not start");
  }
  mg_set_request_handler(server->ctx_, "/metrics", &MetricsServer::HandleRequest, server.get());
  mg_server_port ports[4] = {};
  const int n = mg_get_server_ports(server->ctx_, 4, ports);
  server->port_ = n > 0 ? ports[0].port : 0;
  return server;
}

MetricsServer::~MetricsServer() {
  if (ctx_ != nullptr) mg_stop(ctx_);
}

int MetricsServer::HandleRequest(mg_connection* conn, void* self) {
  const mg_request_info* request = mg_get_request_info(conn);
  if (request == nullptr || request->request_method == nullptr ||
      std::string_view(request->request_method) != "GET") {
    mg_printf(conn,
              "HTTP/1.1 405 Method Not Allowed\r\nAllow: GET\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    return 405;
  }
  auto* server = static_cast<MetricsServer*>(self);
  if (server->gate_) {
    const auto [status, message] = server->gate_(mg_get_header(conn, "Authorization"));
    if (status != 200) {
      const std::string body = message + "\n";
      mg_printf(conn,
                "HTTP/1.1 %d %s\r\n%sContent-Type: text/plain; charset=utf-8\r\nContent-Length: %zu\r\n"
                "Connection: close\r\n\r\n",
                status, status == 401 ? "Unauthorized" : "Forbidden",
                status == 401 ? "WWW-Authenticate: Bearer realm=\"gradwatch\"\r\n" : "", body.size());
      mg_write(conn, body.data(), body.size());
      return status;
    }
  }
  server->Serve(conn);
  return 200;
}

void MetricsServer::Serve(mg_connection* conn) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<Buffers> buffers = TakeBuffers();
  Exposition& text = buffers->text;
  text.Clear();
  {
    MutexLock lock(&render_mu_);
    AppendFamilies(text.NewChunk(), own_registry_->Collect());
    for (const Renderer& render : renderers_) render(text);
  }

  const bool gzip = AcceptsGzip(conn) && Gzip(text, buffers->gzip);
  const size_t body_size = gzip ? buffers->gzip.size : text.size();
  mg_printf(conn, "HTTP/1.1 200 OK\r\nContent-Type: %s\r\n%sContent-Length: %zu\r\nConnection: close\r\n\r\n",
            kContentType, gzip ? "Content-Encoding: gzip\r\n" : "", body_size);
  if (gzip) {
    mg_write(conn, buffers->gzip.data.get(), buffers->gzip.size);
  } else {
    for (size_t i = 0; i < text.chunk_count(); ++i) mg_write(conn, text.chunk(i).data(), text.chunk(i).size());
  }
  GiveBack(std::move(buffers));

  latencies_us_->Observe(static_cast<double>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count()));
  transferred_bytes_->Increment(static_cast<double>(body_size));
  scrapes_->Increment();
}

std::unique_ptr<MetricsServer::Buffers> MetricsServer::TakeBuffers() {
  {
    MutexLock lock(&pool_mu_);
    if (!pool_.empty()) {
      std::unique_ptr<Buffers> buffers = std::move(pool_.back());
      pool_.pop_back();
      return buffers;
    }
  }
  return std::make_unique<Buffers>();
}

void MetricsServer::GiveBack(std::unique_ptr<Buffers> buffers) {
  MutexLock lock(&pool_mu_);
  if (pool_.empty()) pool_.push_back(std::move(buffers));
}

}  // namespace gradwatch::exporter
