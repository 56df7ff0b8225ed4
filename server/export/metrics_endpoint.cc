#include "server/export/metrics_endpoint.h"

#include <chrono>
#include <string_view>

#include <spdlog/spdlog.h>
#include <zlib.h>

#include "server/export/text_format.h"

namespace gradwatch::exporter {

namespace {

// Prometheus' Go client names this content type for text format 0.0.4.
constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// Whether the request's Accept-Encoding names gzip (Prometheus sends "gzip").
bool AcceptsGzip(const web::Request& request) {
  return request.Header("accept-encoding").find("gzip") != std::string_view::npos;
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

}  // namespace

MetricsEndpoint::MetricsEndpoint(std::vector<Renderer> renderers)
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

MetricsEndpoint::~MetricsEndpoint() = default;

web::Response MetricsEndpoint::Handle(const web::Request& request) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<Buffers> buffers = TakeBuffers();
  Exposition& text = buffers->text;
  text.Clear();
  {
    MutexLock lock(&render_mu_);
    AppendFamilies(text.NewChunk(), own_registry_->Collect());
    for (const Renderer& render : renderers_) render(text);
  }

  web::Response response;
  response.content_type = kContentType;
  const bool gzip = AcceptsGzip(request) && Gzip(text, buffers->gzip);
  if (gzip) {
    response.headers.emplace_back("Content-Encoding", "gzip");
    response.pieces.emplace_back(buffers->gzip.data.get(), buffers->gzip.size);
  } else {
    for (size_t i = 0; i < text.chunk_count(); ++i) response.pieces.emplace_back(text.chunk(i));
  }
  const size_t body_size = response.body_size();
  // Released once the response is written: the buffers go back, and the scrape is counted.
  response.keeper = std::shared_ptr<const void>(buffers.release(), [this, start, body_size](Buffers* p) {
    GiveBack(std::unique_ptr<Buffers>(p));
    latencies_us_->Observe(static_cast<double>(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count()));
    transferred_bytes_->Increment(static_cast<double>(body_size));
    scrapes_->Increment();
  });
  return response;
}

std::unique_ptr<MetricsEndpoint::Buffers> MetricsEndpoint::TakeBuffers() {
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

void MetricsEndpoint::GiveBack(std::unique_ptr<Buffers> buffers) {
  MutexLock lock(&pool_mu_);
  if (pool_.empty()) pool_.push_back(std::move(buffers));
}

}  // namespace gradwatch::exporter
