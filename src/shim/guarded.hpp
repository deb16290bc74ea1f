// Error plumbing shared by treetrain's C++ shims: every entry point runs its body through
// `guarded`, which turns any C++ exception into the first line of its message in the caller's
// buffer, so Rust gets a typed error and libtorch never aborts the process.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace treetrain_shim {

inline void set_error(char* err, size_t len, const std::string& message) {
  if (err == nullptr || len == 0) return;
  size_t n = std::min(len - 1, message.size());
  std::memcpy(err, message.data(), n);
  err[n] = '\0';
}

// The first line of a c10 error: the rest is a C++ backtrace no user needs.
inline std::string first_line(const std::string& what) {
  auto end = what.find('\n');
  return end == std::string::npos ? what : what.substr(0, end);
}

template <typename F>
int guarded(char* err, size_t len, F&& body) {
  try {
    body();
    return 0;
  } catch (const c10::Error& e) {
    set_error(err, len, first_line(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    set_error(err, len, first_line(e.what()));
  } catch (...) {
    set_error(err, len, "unknown C++ exception");
  }
  return 1;
}

}  // namespace treetrain_shim
