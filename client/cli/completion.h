// `gradwatch completion bash|zsh`: a completion script for the shell, generated from the command
// tree itself (its commands, their options, which options take a value), so it never falls behind.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace gradwatch::cli {

// The script for `shell` ("bash" or "zsh", which loads the bash one through bashcompinit), or
// nullopt for another shell.
std::optional<std::string> CompletionScript(const CLI::App& app, std::string_view shell);

}  // namespace gradwatch::cli
