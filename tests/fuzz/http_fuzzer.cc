// Fuzzes gradwatchd's HTTP listener as a client reaches it: each input is the bytes a client
// sends on one connection to a real web::Server (Boost.Beast, the daemon's limits: a 16 KiB head,
// a 1 MiB body, the header and idle deadlines), serving the run view and its JSON API over a
// registry holding one run with steps and events. The connection is half-closed after the bytes
// and read until the server closes it, so every request the bytes hold (pipelined, keep-alive,
// malformed, oversized) is parsed, routed and answered. Loopback only.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include <spdlog/spdlog.h>

#include "server/core/clock.h"
#include "server/daemon/run_view.h"
#include "server/ingest/queries.h"
#include "server/runs/daemon_stats.h"
#include "server/runs/registry.h"
#include "server/web/server.h"

namespace {

using namespace gradwatch;

// The run's one rank, whose answers nobody reads.
class Quiet final : public runs::StreamSink {
 public:
  void SendAck(uint64_t, uint64_t) override {}
  void SendError(const runs::IngestError&) override {}
  void Supersede() override {}
  void SendFinished(const std::string&, uint64_t) override {}
};

struct Listener {
  FakeClock clock;
  Quiet rank0;
  runs::DaemonStats stats;
  runs::RunOptions options;
  std::unique_ptr<runs::RunRegistry> registry;
  std::unique_ptr<web::Server> server;

  Listener() {
    registry = std::make_unique<runs::RunRegistry>(options, /*max_runs=*/4, &stats, &clock);
    RunMeta meta;
    meta.run_id = "moe/run:1";
    meta.world_size = 1;
    ParamInfo gain;
    gain.name = "final_norm.weight";
    gain.kind = ParamKind::kNormGain;
    meta.params = {gain};
    runs::AttachInfo info;
    runs::IngestError error{runs::IngestErrorReason::kInvalidHello, ""};
    auto run = registry->Attach(meta, 0, &rank0, &info, &error);
    if (!run) throw std::runtime_error("attach: " + error.message);
    for (uint64_t step = 1; step <= 64; ++step) {
      RankStep s;
      s.step = step;
      s.seq = step;
      s.loss = 2.0;
      s.total_grad = NormContribution::FromNorm(0.5 + 0.01 * static_cast<double>(step));
      run->AddStep(0, s, &rank0);
    }
    EventRecord event;
    event.step = 32;
    event.text = "switched routing";
    event.source = "trainer";
    run->AddEvent(std::move(event));
    ingest::QuerySources sources{registry.get(), &clock, nullptr, {}, {}};
    web::ServerOptions server_options;
    server_options.listen = "127.0.0.1:0";
    server_options.header_timeout = std::chrono::milliseconds(500);
    server_options.idle_timeout = std::chrono::milliseconds(500);
    server_options.write_timeout = std::chrono::seconds(2);
    auto started = web::Server::Start(server_options, daemon::RunViewRoutes(sources, nullptr));
    if (!started.ok()) throw std::runtime_error("listen: " + started.status().message());
    server = std::move(started).value();
  }
};

Listener* listener = nullptr;

// Sends `data` on a new connection, half-closes it, and reads until the server closes it (at most
// a few seconds: the header and idle deadlines end any connection that waits for more).
void Exchange(int port, const uint8_t* data, size_t size) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return;
  }
  size_t sent = 0;
  while (sent < size) {
    const ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  ::shutdown(fd, SHUT_WR);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  char buf[65536];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) != 1) continue;
    if (::recv(fd, buf, sizeof buf, 0) <= 0) break;
  }
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  listener = new Listener();  // one server for the whole run, as a daemon has
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (size_t{2} << 20)) return -1;  // past the body limit: one answer (413), nothing new to cover
  Exchange(listener->server->port(), data, size);
  return 0;
}
