#include "kvferry/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>

#include "base/config_table.h"

namespace kvferry {

using internal::KnobDecl;

namespace {

std::string EnvName(std::string_view knob) {
  std::string s = "KVFERRY_";
  for (char c : knob) s += (c == '.' || c == '-') ? '_' : static_cast<char>(std::toupper(c));
  return s;
}

std::string Constraint(const KnobDecl& d) {
  switch (d.type) {
    case KnobType::kInt:
      return fmt::format("[{}, {}]", d.min, d.max);
    case KnobType::kBool:
      return "true|false";
    case KnobType::kString:
      return std::string(d.choices);
  }
  return {};
}

// Validates text for a knob; returns the canonical text.
StatusOr<std::string> Validate(const KnobDecl& d, std::string_view text) {
  auto bad = [&](std::string_view why) {
    return Status::InvalidArgument(
        fmt::format("knob {}: value '{}' {}; expected {}", d.name, text, why, Constraint(d)));
  };
  switch (d.type) {
    case KnobType::kInt: {
      int64_t v = 0;
      auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec != std::errc() || p != text.data() + text.size()) return bad("is not an integer");
      if (v < d.min || v > d.max) return bad("is out of range");
      return std::to_string(v);
    }
    case KnobType::kBool: {
      if (text == "1" || text == "true" || text == "on" || text == "yes")
        return std::string("true");
      if (text == "0" || text == "false" || text == "off" || text == "no")
        return std::string("false");
      return bad("is not a boolean");
    }
    case KnobType::kString: {
      if (d.choices.empty()) return std::string(text);
      std::string_view rest = d.choices;
      while (!rest.empty()) {
        size_t bar = rest.find('|');
        if (rest.substr(0, bar) == text) return std::string(text);
        if (bar == std::string_view::npos) break;
        rest.remove_prefix(bar + 1);
      }
      return bad("is not one of the choices");
    }
  }
  return bad("has an unknown type");
}

}  // namespace

struct Config::Impl {
  struct Entry {
    const KnobDecl* decl;
    std::string value;
    KnobSource source;
  };
  mutable std::mutex mu;
  std::map<std::string, Entry, std::less<>> entries;  // guarded by mu
  std::vector<std::string> env_errors;                // guarded by mu

  const Entry& Find(std::string_view name, KnobType type) const {
    auto it = entries.find(name);
    if (it == entries.end() || it->second.decl->type != type) {
      std::fprintf(stderr, "kvferry: config knob '%.*s' is not declared with this type\n",
                   static_cast<int>(name.size()), name.data());
      std::abort();
    }
    return it->second;
  }
};

Config::Config() : impl_(new Impl) {
  auto table = internal::Knobs();
  for (int i = 0; i < table.count; ++i) {
    const KnobDecl& d = table.rows[i];
    Impl::Entry e{&d, std::string(d.default_value), KnobSource::kDefault};
    // The one getenv of the library.
    if (const char* env = std::getenv(EnvName(d.name).c_str())) {
      auto v = Validate(d, env);
      if (v.ok()) {
        e.value = *v;
        e.source = KnobSource::kEnvironment;
      } else {
        impl_->env_errors.push_back(
            fmt::format("{}='{}': {}", EnvName(d.name), env, v.status().message()));
      }
    }
    impl_->entries.emplace(std::string(d.name), std::move(e));
  }
}

Config::~Config() { delete impl_; }

Config& Config::Global() {
  static Config* config = new Config();  // never destroyed: usable from static destructors
  return *config;
}

int64_t Config::Int(std::string_view name) const {
  std::lock_guard lock(impl_->mu);
  return std::stoll(impl_->Find(name, KnobType::kInt).value);
}

bool Config::Bool(std::string_view name) const {
  std::lock_guard lock(impl_->mu);
  return impl_->Find(name, KnobType::kBool).value == "true";
}

std::string Config::String(std::string_view name) const {
  std::lock_guard lock(impl_->mu);
  return impl_->Find(name, KnobType::kString).value;
}

Status Config::Set(std::string_view name, std::string_view value) {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->entries.find(name);
  if (it == impl_->entries.end()) {
    return Status::NotFound(
        fmt::format("no config knob named '{}' (kvferry info lists them)", name));
  }
  KVF_ASSIGN_OR_RETURN(std::string v, Validate(*it->second.decl, value));
  it->second.value = std::move(v);
  it->second.source = KnobSource::kSet;
  return Status::Ok();
}

Status Config::Reset(std::string_view name) {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->entries.find(name);
  if (it == impl_->entries.end())
    return Status::NotFound(fmt::format("no config knob named '{}'", name));
  it->second.value = std::string(it->second.decl->default_value);
  it->second.source = KnobSource::kDefault;
  return Status::Ok();
}

std::vector<KnobView> Config::List() const {
  std::lock_guard lock(impl_->mu);
  std::vector<KnobView> out;
  for (const auto& [name, e] : impl_->entries) {
    out.push_back(KnobView{name, e.decl->type, std::string(e.decl->default_value), e.value,
                           std::string(e.decl->doc), Constraint(*e.decl), EnvName(name), e.source});
  }
  return out;
}

std::vector<std::string> Config::EnvironmentErrors() const {
  std::lock_guard lock(impl_->mu);
  return impl_->env_errors;
}

}  // namespace kvferry
