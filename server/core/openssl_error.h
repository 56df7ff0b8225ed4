// OpenSSL's reason for the last failure on this thread, as text; the error queue is left empty.
#pragma once

#include <openssl/err.h>

#include <string>

namespace gradwatch {

inline std::string OpenSslError() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "unknown error";
  char text[256];
  ERR_error_string_n(code, text, sizeof text);
  return text;
}

}  // namespace gradwatch
