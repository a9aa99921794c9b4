// Config: the one registry of kvferry's knobs.
//
// Every knob is declared once, in src/base/config_table.cc, with a name ("transfer.timeout_ms"),
// a type, a default, a validator (range or choices) and a one-line doc. The environment can
// override a knob (KVFERRY_TRANSFER_TIMEOUT_MS for "transfer.timeout_ms"); this registry is the
// only place in the library that reads the environment, once, at first use. `kvferry info`
// prints every knob. Thread-safe: all methods may be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/export.h"
#include "kvferry/status.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

enum class KnobType { kBool, kInt, kString };

// Where a knob's current value came from.
enum class KnobSource { kDefault, kEnvironment, kSet };

struct KnobView {
  std::string name;
  KnobType type;
  std::string default_value;
  std::string value;
  std::string doc;
  std::string constraint;  // "[1, 3600000]" or "error|warn|info|debug", empty if none
  std::string env_var;
  KnobSource source;
};

class Config {
 public:
  static Config& Global();

  // Typed reads of a declared knob. Reading an undeclared knob or with the wrong type is a
  // programming error: it aborts with the knob's name.
  int64_t Int(std::string_view name) const;
  bool Bool(std::string_view name) const;
  std::string String(std::string_view name) const;

  // Sets a knob from text, validated like an environment value. Errors name the knob, the value
  // and the constraint.
  Status Set(std::string_view name, std::string_view value);
  // Back to the default (and forgets any environment override).
  Status Reset(std::string_view name);

  std::vector<KnobView> List() const;

  // Environment values that were rejected, each naming the variable, the value and the constraint
  // (the default stays in force; the kvferry command refuses to run with any).
  std::vector<std::string> EnvironmentErrors() const;

  struct KVFERRY_HIDDEN Impl;
  ~Config();

 private:
  Config();
  Impl* impl_;
};

}  // namespace kvferry
#pragma GCC visibility pop
