// The run view's files (server/daemon/ui/), embedded in the binary at build time by
// server/daemon/embed_ui.cmake: the daemon serves them without reading the disk or the network.
#pragma once

#include <cstddef>
#include <string_view>

namespace gradwatch::daemon {

struct UiAsset {
  const char* name;          // "index.html"
  const char* content_type;  // "text/html; charset=utf-8"
  const char* data;
  size_t size;
};

// The file called `name`; null when there is none.
const UiAsset* FindUiAsset(std::string_view name);

}  // namespace gradwatch::daemon
