// medusa_plan: what a C++ program binds for each step of the Medusa loop, from an artifact alone.
//
// Reads ARTIFACT/manifest.json and the tree file it names, derives the tree buffers from
// medusa_choices by the rules of docs/cpp_contract.md (and checks them against the buffers
// stored in tree.json), and prints as JSON:
//   * the model geometry;
//   * for a prefill of N prompt tokens after P cached ones and for a tree step after P
//     cached tokens: every input and output of model.onnx with its dtype and concrete shape,
//     the optimization profile that covers it, position_ids and new_token_mask;
//   * the heads call (R = 1): its input and output shapes;
//   * the tree: depth, parent, candidate_index (gather indices into [root, heads_topk]),
//     retrieve_indices;
//   * optionally (--accept TOKENS ARGMAX) greedy acceptance of one tree step: the accepted
//     nodes, the bonus token, the emitted tokens and the KV compaction copies.
//
// Build: g++ -std=c++17 -O2 -o medusa_plan cpp/medusa_plan.cpp   (nlohmann-json3-dev, header only)
// Usage: medusa_plan ARTIFACT [--prompt-len N] [--past P] [--accept t0,t1,... a0,a1,...]
//
// No inference runtime is linked: this is the host-side half of a C++ driver (the part that
// has to agree with medusa_runtime), checked by tests/test_cpp_contract.py.

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

using json = nlohmann::json;
using Path = std::vector<int64_t>;

namespace {

json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  return json::parse(in);
}

// ---------------------------------------------------------------------------
// Tree buffers (docs/cpp_contract.md, "The tree")
// ---------------------------------------------------------------------------

struct Tree {
  int64_t topk = 0;
  std::vector<Path> nodes;                    // node order: root (empty path), then by (depth, path)
  std::vector<int64_t> depth, parent, candidate_index;
  std::vector<std::vector<uint8_t>> mask;     // [T][T], 1 where node i may attend node j
  std::vector<std::vector<int64_t>> retrieve;  // one row per leaf, root first, padded with -1
  size_t size() const { return nodes.size(); }
};

Tree build_tree(const json& tree_json) {
  Tree t;
  t.topk = tree_json.at("topk").get<int64_t>();
  std::vector<Path> paths;
  for (const auto& p : tree_json.at("medusa_choices")) {
    Path path = p.get<Path>();
    if (!path.empty()) paths.push_back(path);
  }
  std::sort(paths.begin(), paths.end(), [](const Path& a, const Path& b) {
    return a.size() != b.size() ? a.size() < b.size() : a < b;
  });
  t.nodes.push_back({});
  t.nodes.insert(t.nodes.end(), paths.begin(), paths.end());
  const size_t T = t.nodes.size();
  std::map<Path, int64_t> index;
  for (size_t n = 0; n < T; ++n) index[t.nodes[n]] = static_cast<int64_t>(n);
  t.depth.assign(T, 0);
  t.parent.assign(T, -1);
  t.candidate_index.assign(T, 0);
  t.mask.assign(T, std::vector<uint8_t>(T, 0));
  t.mask[0][0] = 1;
  for (size_t n = 1; n < T; ++n) {
    const Path& path = t.nodes[n];
    const Path up(path.begin(), path.end() - 1);
    auto it = index.find(up);
    if (it == index.end()) throw std::runtime_error("tree path without its parent");
    if (path.back() < 0 || path.back() >= t.topk) throw std::runtime_error("top-k index out of range");
    t.depth[n] = static_cast<int64_t>(path.size());
    t.parent[n] = it->second;
    t.candidate_index[n] = 1 + (t.depth[n] - 1) * t.topk + path.back();
    t.mask[n] = t.mask[t.parent[n]];  // the parent's ancestors (nodes come after their parent)
    t.mask[n][n] = 1;
  }
  std::vector<bool> has_child(T, false);
  for (size_t n = 1; n < T; ++n) has_child[t.parent[n]] = true;
  const int64_t max_depth = *std::max_element(t.depth.begin(), t.depth.end());
  for (size_t n = 0; n < T; ++n) {
    if (has_child[n]) continue;
    std::vector<int64_t> chain;
    for (int64_t m = static_cast<int64_t>(n); m >= 0; m = t.parent[m]) chain.push_back(m);
    std::reverse(chain.begin(), chain.end());
    chain.resize(static_cast<size_t>(max_depth + 1), -1);
    t.retrieve.push_back(chain);
  }
  return t;
}

// The stored buffers must be the derived ones (a C++ driver may use either).
void check_stored(const Tree& t, const json& tree_json) {
  if (!tree_json.contains("buffers")) return;
  const json& b = tree_json.at("buffers");
  auto same = [&](const char* key, const json& mine) {
    if (b.at(key) != mine) throw std::runtime_error(std::string("tree.json buffer '") + key + "' differs from the derived one");
  };
  same("depth", t.depth);
  same("parent", t.parent);
  same("candidate_index", t.candidate_index);
  same("retrieve_indices", t.retrieve);
  json mask = json::array();
  for (const auto& row : t.mask) {
    json r = json::array();
    for (uint8_t v : row) r.push_back(static_cast<int>(v));
    mask.push_back(r);
  }
  same("attention_mask", mask);
}

// ---------------------------------------------------------------------------
// Shapes and profiles (docs/cpp_contract.md, "Graphs")
// ---------------------------------------------------------------------------

using Sizes = std::map<std::string, int64_t>;

json concrete(const json& tensors, const Sizes& sizes) {
  json out = json::array();
  for (const auto& t : tensors) {
    json shape = json::array();
    for (const auto& d : t.at("shape")) {
      if (d.is_number_integer()) {
        shape.push_back(d.get<int64_t>());
      } else {
        auto it = sizes.find(d.get<std::string>());
        if (it == sizes.end()) throw std::runtime_error("no size for dim " + d.get<std::string>());
        shape.push_back(it->second);
      }
    }
    out.push_back({{"name", t.at("name")}, {"dtype", t.at("dtype")}, {"shape", shape}});
  }
  return out;
}

// The most specific profile (fewest admitted size combinations) containing the sizes; first on a tie.
std::string select_profile(const json& profiles, const Sizes& sizes) {
  static const char* order[] = {"prefill", "tree_step", "decode"};  // engine profile index order
  std::string best;
  double best_volume = 0;
  for (const char* name : order) {
    if (!profiles.contains(name)) continue;
    double volume = 1;
    bool fits = true;
    for (const auto& [dim, range] : profiles.at(name).items()) {
      const int64_t lo = range.at(0).get<int64_t>(), hi = range.at(1).get<int64_t>();
      auto it = sizes.find(dim);
      if (it == sizes.end() || it->second < lo || it->second > hi) fits = false;
      volume *= static_cast<double>(hi - lo + 1);
    }
    if (fits && (best.empty() || volume < best_volume)) {
      best = name;
      best_volume = volume;
    }
  }
  if (best.empty()) throw std::runtime_error("no optimization profile covers the step");
  return best;
}

json step_plan(const json& graph, int64_t S, int64_t P, const std::vector<int64_t>& positions,
               const std::vector<std::vector<uint8_t>>& mask) {
  const Sizes sizes{{"S", S}, {"P", P}};
  json mask_json = json::array();
  for (const auto& row : mask) {
    json r = json::array();
    for (uint8_t v : row) r.push_back(static_cast<int>(v));
    mask_json.push_back(r);
  }
  return {{"S", S},
          {"P", P},
          {"profile", select_profile(graph.at("profiles"), sizes)},
          {"inputs", concrete(graph.at("inputs"), sizes)},
          {"outputs", concrete(graph.at("outputs"), sizes)},
          {"position_ids", positions},
          {"new_token_mask", mask_json}};
}

std::vector<int64_t> parse_ids(const std::string& csv) {
  std::vector<int64_t> out;
  std::stringstream ss(csv);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoll(item));
  return out;
}

// ---------------------------------------------------------------------------
// Greedy acceptance and KV compaction (docs/cpp_contract.md, "The loop", steps 6-7)
// ---------------------------------------------------------------------------

json accept_greedy(const Tree& t, const std::vector<int64_t>& tokens, const std::vector<int64_t>& argmax, int64_t P) {
  const size_t T = t.size();
  if (tokens.size() != T || argmax.size() != T) throw std::runtime_error("--accept needs T tokens and T argmax values");
  std::vector<bool> ok(T, false);
  for (size_t n = 1; n < T; ++n) ok[n] = argmax[t.parent[n]] == tokens[n];
  size_t best = 0;
  int64_t best_len = -1;
  for (size_t r = 0; r < t.retrieve.size(); ++r) {
    int64_t len = 0;
    for (size_t c = 1; c < t.retrieve[r].size() && t.retrieve[r][c] >= 0 && ok[t.retrieve[r][c]]; ++c) ++len;
    if (len > best_len) {  // strictly longer: the first row wins a tie
      best_len = len;
      best = r;
    }
  }
  std::vector<int64_t> accepted(t.retrieve[best].begin(), t.retrieve[best].begin() + best_len + 1);
  const int64_t next = argmax[accepted.back()];
  std::vector<int64_t> emitted;
  for (size_t i = 1; i < accepted.size(); ++i) emitted.push_back(tokens[accepted[i]]);
  emitted.push_back(next);
  json copies = json::array();  // cache slot <- new_key_values row, for every layer's key and value
  for (size_t i = 0; i < accepted.size(); ++i) copies.push_back({{"slot", P + static_cast<int64_t>(i)}, {"row", accepted[i]}});
  return {{"path_index", best}, {"accepted", accepted}, {"next_token", next}, {"emitted", emitted},
          {"kv_copies", copies}, {"new_past", P + static_cast<int64_t>(accepted.size())}};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2) {
      std::cerr << "usage: medusa_plan ARTIFACT [--prompt-len N] [--past P] [--accept TOKENS ARGMAX]\n";
      return 2;
    }
    const std::string dir = argv[1];
    int64_t prompt_len = 8, past = 0;
    std::string accept_tokens, accept_argmax;
    for (int i = 2; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--prompt-len" && i + 1 < argc) {
        prompt_len = std::stoll(argv[++i]);
      } else if (a == "--past" && i + 1 < argc) {
        past = std::stoll(argv[++i]);
      } else if (a == "--accept" && i + 2 < argc) {
        accept_tokens = argv[++i];
        accept_argmax = argv[++i];
      } else {
        throw std::runtime_error("unknown or incomplete argument " + a);
      }
    }
    const json manifest = read_json(dir + "/manifest.json");
    if (manifest.contains("batch"))
      throw std::runtime_error("the artifact's step graph is batched (manifest 'batch', docs/batching.md); this "
                               "planner binds batch-1 step graphs: build with --batch-size 1");
    const json tree_json = read_json(dir + "/" + manifest.at("files").at("tree").get<std::string>());
    const Tree tree = build_tree(tree_json);
    if (static_cast<int64_t>(tree.size()) != manifest.at("tree").at("size").get<int64_t>())
      throw std::runtime_error("tree size differs from the manifest");
    check_stored(tree, tree_json);
    const json& m = manifest.at("model");
    const json& model_graph = manifest.at("graphs").at("model");
    const json& heads_graph = manifest.at("graphs").at("heads");
    const int64_t T = static_cast<int64_t>(tree.size());
    const int64_t capacity = m.at("max_context").get<int64_t>();

    std::vector<int64_t> prefill_pos(prompt_len);
    std::vector<std::vector<uint8_t>> causal(prompt_len, std::vector<uint8_t>(prompt_len, 0));
    for (int64_t i = 0; i < prompt_len; ++i) {
      prefill_pos[i] = past + i;
      for (int64_t j = 0; j <= i; ++j) causal[i][j] = 1;
    }
    std::vector<int64_t> tree_pos(T);
    for (int64_t n = 0; n < T; ++n) tree_pos[n] = past + tree.depth[n];

    json out;
    out["model"] = {{"num_layers", m.at("num_layers")}, {"num_kv_heads", m.at("num_kv_heads")},
                    {"head_dim", m.at("head_dim")}, {"hidden_size", m.at("hidden_size")},
                    {"vocab_size", m.at("vocab_size")}, {"medusa_heads", m.at("medusa_heads")},
                    {"max_context", capacity}, {"kv_dtype", manifest.at("precision").at("kv_dtype")},
                    {"step_topk", manifest.at("step_topk")}, {"eos_token_ids", manifest.at("tokenizer").at("eos_token_ids")}};
    out["prefill"] = step_plan(model_graph, prompt_len, past, prefill_pos, causal);
    out["tree_step"] = step_plan(model_graph, T, past, tree_pos, tree.mask);
    out["tree_step"]["fits"] = past + T <= capacity;  // else: a root-only step (decode profile), or stop
    out["heads"] = {{"inputs", concrete(heads_graph.at("inputs"), {{"R", 1}})},
                    {"outputs", concrete(heads_graph.at("outputs"), {{"R", 1}})}};
    out["tree"] = {{"size", T}, {"topk", tree.topk}, {"depth", tree.depth}, {"parent", tree.parent},
                   {"candidate_index", tree.candidate_index}, {"retrieve_indices", tree.retrieve},
                   {"flat_candidates", 1 + m.at("medusa_heads").get<int64_t>() * tree.topk}};
    if (!accept_tokens.empty())
      out["accept"] = accept_greedy(tree, parse_ids(accept_tokens), parse_ids(accept_argmax), past);
    std::cout << out.dump() << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "medusa_plan: " << e.what() << "\n";
    return 1;
  }
}
