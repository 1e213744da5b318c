// The NGRAM / SUFFIX drafters' n-gram trie (the only implementation; used through
// specserve/speculative/ngram_cache.py: NgramCache, whose docstrings say what each operation means).
// Representation:
//   - per-node arrays indexed by node id (0 = the root, also the global LRU's sentinel); evicted
//     ids are reused and a version bump tells stale references apart;
//   - a node's children are an intrusive doubly linked sibling list in recency order (least
//     recent first), plus one hash table from (parent, token) to child for lookups;
//   - request states (the anchors `extend` continues from) are keyed by strings (the Python
//     wrapper turns other keys into strings).
// Tree sizing and backoff are the caller's: `draft_lists` builds the tree for the whole budget,
// and any smaller budget's tree is a prefix of it. tests/helpers/ngram_reference.py, a small
// Python trie, checks the counts, recency orders and drafts (tests/unit/test_ngram_reference.py).
// Not thread-safe: the model runner calls it from one thread.

#include <torch/extension.h>

#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <list>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace specserve {
namespace {

namespace py = pybind11;

constexpr int kRoot = 0;
constexpr int64_t kMissing = -1;  // recorded version of an absent n-gram: never matches

// (parent, token) -> child, open addressing with linear probing and backward-shift deletion
class ChildTable {
 public:
  ChildTable() { resize(1024); }

  // room for `links` entries at load <= 1/2, allocated (and written) now: never grows after
  void reserve(size_t links) {
    size_t n = 1024;
    while (n < 2 * (links + 1)) n *= 2;
    if (n > keys_.size()) resize(n);
  }

  int find(int parent, int64_t token) const {
    const uint64_t k = key(parent, token);
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (keys_[i] == kEmpty) return -1;
      if (keys_[i] == k) return vals_[i];
    }
  }

  void insert(int parent, int64_t token, int child) {
    if (2 * (used_ + 1) > keys_.size()) resize(2 * keys_.size());
    put(key(parent, token), child);
    ++used_;
  }

  void erase(int parent, int64_t token) {
    const uint64_t k = key(parent, token);
    size_t i = slot(k);
    while (keys_[i] != k) {
      if (keys_[i] == kEmpty) throw std::logic_error("ngram trie: erasing a missing child");
      i = (i + 1) & mask_;
    }
    // backward shift: move later entries of the probe run into the hole
    size_t j = i;
    for (;;) {
      j = (j + 1) & mask_;
      if (keys_[j] == kEmpty) break;
      const size_t home = slot(keys_[j]);
      // the entry at j may fill the hole at i unless its home lies cyclically in (i, j]
      const bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
      if (stays) continue;
      keys_[i] = keys_[j];
      vals_[i] = vals_[j];
      i = j;
    }
    keys_[i] = kEmpty;
    --used_;
  }

  size_t size() const { return used_; }
  size_t bytes() const { return keys_.capacity() * sizeof(uint64_t) + vals_.capacity() * sizeof(int); }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  static uint64_t key(int parent, int64_t token) {
    return (uint64_t(uint32_t(parent)) << 32) | uint64_t(uint32_t(token));
  }
  size_t slot(uint64_t k) const {
    k ^= k >> 31;
    k *= 0x9E3779B97F4A7C15ull;
    return size_t(k >> shift_);
  }
  void put(uint64_t k, int v) {
    size_t i = slot(k);
    while (keys_[i] != kEmpty) i = (i + 1) & mask_;
    keys_[i] = k;
    vals_[i] = v;
  }
  void resize(size_t n) {
    std::vector<uint64_t> old_keys = std::move(keys_);
    std::vector<int> old_vals = std::move(vals_);
    keys_.assign(n, kEmpty);
    vals_.assign(n, -1);
    mask_ = n - 1;
    shift_ = 64 - __builtin_ctzll(n);
    for (size_t i = 0; i < old_keys.size(); ++i)
      if (old_keys[i] != kEmpty) put(old_keys[i], old_vals[i]);
  }

  std::vector<uint64_t> keys_;
  std::vector<int> vals_;
  size_t mask_ = 0, used_ = 0;
  int shift_ = 64;
};

struct ReqState {
  std::vector<int64_t> tail;
  std::vector<int> anchors;
  std::vector<int64_t> versions;
  std::list<std::string>::iterator lru;
};

using Scored = std::tuple<std::vector<int64_t>, std::vector<int>, std::vector<double>, double, int>;

class NgramTrie {
 public:
  NgramTrie(int64_t capacity, int depth, int min_match_window, int max_bfs_breadth,
            std::vector<int> breadth, bool prob, int64_t max_tracked_requests)
      : capacity_(capacity), depth_(depth), min_match_(min_match_window),
        max_breadth_(max_bfs_breadth), breadth_(std::move(breadth)), prob_(prob),
        max_states_(max_tracked_requests) {
    if (depth_ < 2 || capacity_ < int64_t(depth_) * depth_ || int(breadth_.size()) != depth_)
      throw std::invalid_argument("ngram trie: bad configuration");
    // Every node's storage is allocated and written here, once, for `capacity` nodes: the
    // trie's memory is its ceiling from the start (RSS does not creep up as it fills, and no
    // step ever pays for a vector doubling its 2M entries)
    const size_t n = size_t(capacity_) + 1;
    for (auto* v : {&tok_, &cnt_, &tot_, &ver_}) v->assign(n, 0);
    for (auto* v : {&par_, &prv_, &nxt_, &fk_, &lk_, &sp_, &sn_}) v->assign(n, -1);
    nk_.assign(n, 0);
    free_.reserve(n);
    table_.reserve(n);
    new_node(-1, -1);  // the root: its own LRU sentinel
    prv_[kRoot] = nxt_[kRoot] = kRoot;
  }

  // bytes of the per-node arrays and the child table (allocated up front)
  int64_t reserved_bytes() const {
    size_t b = table_.bytes();
    for (const auto* v : {&tok_, &cnt_, &tot_, &ver_}) b += v->capacity() * sizeof(int64_t);
    for (const auto* v : {&par_, &prv_, &nxt_, &fk_, &lk_, &sp_, &sn_, &nk_, &free_})
      b += v->capacity() * sizeof(int);
    return int64_t(b);
  }

  int64_t num_nodes() const { return num_nodes_; }
  int last_match_len() const { return last_match_; }

  int64_t count(const std::vector<int64_t>& ngram) const {
    const int n = walk(ngram, 0);
    return n < 0 ? 0 : cnt_[n];
  }

  void insert(const std::vector<int64_t>& tokens) {
    std::vector<int> anchors{kRoot};
    std::vector<int64_t> versions{0}, tail;
    feed(anchors, versions, tail, tokens);
  }

  void extend(const std::string& key, const std::vector<int64_t>& context,
              const std::vector<int64_t>& new_tokens) {
    std::vector<int64_t> tail = tail_of(context);
    auto it = states_.find(key);
    std::vector<int> anchors;
    std::vector<int64_t> versions;
    if (it != states_.end() && it->second.tail == tail) {
      anchors = std::move(it->second.anchors);
      versions = std::move(it->second.versions);
    } else {
      lookup_anchors(tail, anchors, versions);
    }
    feed(anchors, versions, tail, new_tokens);
    if (it == states_.end()) {
      order_.push_back(key);
      ReqState st{std::move(tail), std::move(anchors), std::move(versions), std::prev(order_.end())};
      states_.emplace(key, std::move(st));
      if (int64_t(states_.size()) > max_states_) {
        states_.erase(order_.front());
        order_.pop_front();
      }
    } else {
      ReqState& st = it->second;
      st.tail = std::move(tail);
      st.anchors = std::move(anchors);
      st.versions = std::move(versions);
      order_.splice(order_.end(), order_, st.lru);
    }
  }

  void release(const std::string& key) {
    auto it = states_.find(key);
    if (it == states_.end()) return;
    order_.erase(it->second.lru);
    states_.erase(it);
  }

  void remove(const std::vector<int64_t>& toks) {
    const size_t n = toks.size();
    for (size_t s = 0; s < n; ++s) {
      int node = kRoot;
      for (size_t i = s; i < std::min(s + size_t(depth_), n); ++i) {
        const int c = child(node, toks[i]);
        if (c < 0) break;
        tot_[node] -= 1;
        cnt_[c] -= 1;
        tops_.erase(node);
        if (cnt_[c] <= 0) {
          drop_subtree(c);
          break;
        }
        node = c;
      }
    }
  }

  Scored draft_scored(const std::vector<int64_t>& context, int64_t max_nodes, double spec_factor,
                      double spec_offset, double min_prob, const std::optional<std::string>& key) {
    const std::vector<int64_t> tail = tail_of(context);
    if (tail.empty()) throw std::invalid_argument("drafting needs at least one context token");
    Scored best{{tail.back()}, {-1}, {1.0}, 0.0, 0};
    last_match_ = 0;
    if (max_nodes <= 1) return best;
    Matcher mt(*this, tail, key);
    int node, m;
    while (mt.next(node, m)) {
      if (!last_match_) last_match_ = m;
      const int64_t limit = std::min<int64_t>(
          max_nodes - 1, int64_t(spec_factor * double(m) + spec_offset + 1e-9));
      if (double(limit) <= std::get<3>(best)) continue;
      Scored got = grow_best_first(tail.back(), node, limit, min_prob);
      std::get<4>(got) = m;
      if (std::get<3>(got) > std::get<3>(best)) best = std::move(got);
    }
    return best;
  }

  // the tree for `budget` nodes (root included) from every match, longest first; the
  // caller cuts it to the size it wants (a smaller budget's tree is a prefix of this one)
  std::pair<std::vector<int64_t>, std::vector<int>> draft_lists(
      const std::vector<int64_t>& context, int64_t budget, const std::optional<std::string>& key) {
    if (budget < 1) throw std::invalid_argument("num_draft_tokens counts the root, >= 1");
    const std::vector<int64_t> tail = tail_of(context);
    if (tail.empty()) throw std::invalid_argument("drafting needs at least one context token");
    std::vector<int64_t> tokens{tail.back()};
    std::vector<int> parents{-1};
    last_match_ = 0;
    if (budget <= 1) return {tokens, parents};
    Matcher mt(*this, tail, key);
    int node, m;
    if (!mt.next(node, m)) return {tokens, parents};
    last_match_ = m;
    if (prob_)
      build_prob(mt, node, m, tokens, parents, budget);
    else
      build_bfs(mt, node, m, tokens, parents, budget);
    return {tokens, parents};
  }

  // every stored n-gram with its count, depth first, children in recency order (tests)
  std::vector<std::pair<std::vector<int64_t>, int64_t>> dump() const {
    std::vector<std::pair<std::vector<int64_t>, int64_t>> out;
    std::vector<std::pair<std::vector<int64_t>, int>> stack{{{}, kRoot}};
    while (!stack.empty()) {
      auto [path, node] = std::move(stack.back());
      stack.pop_back();
      for (int c = fk_[node]; c >= 0; c = sn_[c]) {
        std::vector<int64_t> gram = path;
        gram.push_back(tok_[c]);
        out.emplace_back(gram, cnt_[c]);
        stack.emplace_back(std::move(gram), c);
      }
    }
    return out;
  }

  void check_integrity() const {
    auto need = [](bool ok, const char* what) {
      if (!ok) throw std::logic_error(std::string("ngram trie integrity: ") + what);
    };
    std::vector<int> lru;
    std::vector<char> queued(tok_.size(), 0);
    for (int n = nxt_[kRoot]; n != kRoot; n = nxt_[n]) {
      need(prv_[nxt_[n]] == n, "LRU links broken");
      need(!queued[n], "a node is queued twice");
      queued[n] = 1;
      lru.push_back(n);
      need(int64_t(lru.size()) <= num_nodes_, "LRU cycle or dead nodes");
    }
    std::vector<char> reach(tok_.size(), 0);
    int64_t reachable = 0, links = 0;
    std::vector<std::pair<int, int>> stack{{kRoot, 0}};
    while (!stack.empty()) {
      auto [node, d] = stack.back();
      stack.pop_back();
      if (node != kRoot) {
        reach[node] = 1;
        ++reachable;
        need(1 <= d && d <= depth_, "node deeper than max_trie_depth");
        need(cnt_[node] >= 1, "a stored n-gram occurred at least once");
        need((prv_[node] >= 0) == bool(queued[node]), "_prev disagrees with the LRU");
        need(nk_[node] > 0 || queued[node], "a leaf must be in the LRU");
      }
      int64_t total = 0, k = 0;
      std::vector<int> kids;
      for (int c = fk_[node], before = -1; c >= 0; before = c, c = sn_[c]) {
        need(sp_[c] == before, "sibling links broken");
        need(par_[c] == node, "child's parent link broken");
        need(table_.find(node, tok_[c]) == c, "child table disagrees");
        total += cnt_[c];
        ++k;
        ++links;
        kids.push_back(c);
        stack.emplace_back(c, d + 1);
      }
      need(k == nk_[node] && (k == 0 || lk_[node] == kids.back()), "child count drift");
      need(tot_[node] == total, "child total drift");
      auto top = tops_.find(node);
      if (top != tops_.end()) need(top->second == fresh_top(node), "stale top-k");
    }
    need(reachable == num_nodes_, "num_nodes disagrees with the reachable nodes");
    need(num_nodes_ <= capacity_, "more nodes than capacity");
    need(int64_t(table_.size()) == links, "child table holds dead entries");
    std::vector<char> freed(tok_.size(), 0);
    for (int f : free_) {
      need(!reach[f] && !freed[f], "a free id is live or freed twice");
      freed[f] = 1;
    }
    need(int64_t(free_.size()) + num_nodes_ + 1 == allocated_,
         "an id is neither live nor free");
    for (int n : lru) need(reach[n], "dead node in the LRU");
    for (const auto& kv : tops_) need(kv.first == kRoot || reach[kv.first], "top-k of a dead node");
    need(int64_t(states_.size()) <= max_states_, "too many request states");
    for (const auto& kv : states_) {
      const ReqState& st = kv.second;
      need(st.anchors.size() == st.versions.size() && st.anchors.size() == st.tail.size() + 1 &&
               int(st.anchors.size()) <= depth_,
           "request state sizes");
      need(st.anchors[0] == kRoot, "anchors[0] must be the root");
    }
  }

 private:
  // suffix matches of a tail, longest first (down to min_match_window), nodes with children
  // only; a request's anchors stand in for lookups while their versions hold
  class Matcher {
   public:
    Matcher(const NgramTrie& t, const std::vector<int64_t>& tail,
            const std::optional<std::string>& key)
        : t_(t), tail_(tail), m_(int(tail.size())) {
      if (key) {
        auto it = t.states_.find(*key);
        if (it != t.states_.end() && it->second.tail == tail) st_ = &it->second;
      }
    }
    bool next(int& node, int& m) {
      const int n = int(tail_.size());
      for (; m_ >= t_.min_match_; --m_) {
        int x;
        if (st_ && t_.ver_[st_->anchors[m_]] == st_->versions[m_])
          x = st_->anchors[m_];
        else
          x = t_.walk(tail_, n - m_);
        if (x >= 0 && t_.nk_[x] > 0) {
          node = x;
          m = m_--;
          return true;
        }
      }
      return false;
    }

   private:
    const NgramTrie& t_;
    const std::vector<int64_t>& tail_;
    const ReqState* st_ = nullptr;
    int m_;
  };

  std::vector<int64_t> tail_of(const std::vector<int64_t>& context) const {
    const size_t n = context.size(), keep = size_t(depth_ - 1);
    return std::vector<int64_t>(context.begin() + (n > keep ? n - keep : 0), context.end());
  }

  int child(int node, int64_t t) const {
    const int k = nk_[node];
    if (k == 0) return -1;
    if (k == 1) return tok_[fk_[node]] == t ? fk_[node] : -1;
    return table_.find(node, t);
  }

  int walk(const std::vector<int64_t>& tail, size_t start) const {
    int node = kRoot;
    for (size_t i = start; i < tail.size(); ++i) {
      node = child(node, tail[i]);
      if (node < 0) return -1;
    }
    return node;
  }

  void lookup_anchors(const std::vector<int64_t>& tail, std::vector<int>& anchors,
                      std::vector<int64_t>& versions) const {
    anchors.assign(1, kRoot);
    versions.assign(1, 0);
    const size_t n = tail.size();
    for (size_t k = 1; k <= n; ++k) {
      const int node = walk(tail, n - k);
      anchors.push_back(std::max(node, kRoot));
      versions.push_back(node >= 0 ? ver_[node] : kMissing);
    }
  }

  void touch(int n) {
    int p = prv_[n];
    if (p >= 0) {
      const int q = nxt_[n];
      nxt_[p] = q;
      prv_[q] = p;
    }
    p = prv_[kRoot];
    nxt_[p] = n;
    prv_[n] = p;
    nxt_[n] = kRoot;
    prv_[kRoot] = n;
  }

  void to_front(int n) {  // a parked node that became a leaf: older than everything queued
    const int q = nxt_[kRoot];
    nxt_[kRoot] = n;
    prv_[n] = kRoot;
    nxt_[n] = q;
    prv_[q] = n;
  }

  void sib_append(int p, int n) {
    sp_[n] = lk_[p];
    sn_[n] = -1;
    if (lk_[p] >= 0)
      sn_[lk_[p]] = n;
    else
      fk_[p] = n;
    lk_[p] = n;
    ++nk_[p];
  }

  void sib_unlink(int p, int n) {
    if (sp_[n] >= 0)
      sn_[sp_[n]] = sn_[n];
    else
      fk_[p] = sn_[n];
    if (sn_[n] >= 0)
      sp_[sn_[n]] = sp_[n];
    else
      lk_[p] = sp_[n];
    sp_[n] = sn_[n] = -1;
    --nk_[p];
  }

  int new_node(int parent, int64_t t) {
    int n;
    if (!free_.empty()) {
      n = free_.back();
      free_.pop_back();
    } else {  // a never-used id: its fields still hold the constructor's values
      if (allocated_ >= int64_t(tok_.size())) throw std::logic_error("ngram trie: out of ids");
      n = int(allocated_++);
    }
    tok_[n] = t;
    par_[n] = parent;
    cnt_[n] = parent >= 0 ? 1 : 0;
    tot_[n] = 0;
    return n;
  }

  // a new leaf (count 1), its parent's most recent child; evicts first when full. The caller
  // updates the parent's total and top list.
  int add_child(int parent, int64_t t) {
    if (num_nodes_ >= capacity_) evict_one();
    const int n = new_node(parent, t);
    sib_append(parent, n);
    table_.insert(parent, t, n);
    touch(n);
    ++num_nodes_;
    return n;
  }

  void update_top(std::vector<int>& top, int node) {
    const int64_t c = cnt_[node];
    int i;
    auto at = std::find(top.begin(), top.end(), node);
    if (at != top.end()) {
      i = int(at - top.begin());
    } else if (int(top.size()) < max_breadth_) {
      top.push_back(node);
      i = int(top.size()) - 1;
    } else if (c >= cnt_[top.back()]) {
      top.back() = node;
      i = int(top.size()) - 1;
    } else {
      return;
    }
    while (i > 0 && cnt_[top[i - 1]] <= c) {
      std::swap(top[i - 1], top[i]);
      --i;
    }
  }

  void feed(std::vector<int>& anchors, std::vector<int64_t>& versions, std::vector<int64_t>& tail,
            const std::vector<int64_t>& tokens) {
    std::vector<int> next_anchors;
    std::vector<int64_t> next_versions;
    for (const int64_t t : tokens) {
      next_anchors.assign(1, kRoot);
      next_versions.assign(1, 0);
      for (size_t k = 0; k < anchors.size(); ++k) {
        int a = anchors[k];
        if (ver_[a] != versions[k])
          a = materialize(tail, k);  // missing, or evicted since recorded
        else if (a && nxt_[a] != kRoot)
          touch(a);  // the path stays recent; `a` cannot be the eviction victim below
        int n = child(a, t);
        if (n < 0) {
          n = add_child(a, t);
        } else {
          cnt_[n] += 1;
          // the most recent sibling goes last (not kept for the root: never drafted from)
          if (a && nk_[a] >= 2 && lk_[a] != n) {
            sib_unlink(a, n);
            sib_append(a, n);
          }
          touch(n);
        }
        tot_[a] += 1;
        if (!tops_.empty()) {
          auto top = tops_.find(a);
          if (top != tops_.end()) update_top(top->second, n);
        }
        if (int(k) + 1 < depth_) {
          next_anchors.push_back(n);
          next_versions.push_back(ver_[n]);
        }
      }
      anchors.swap(next_anchors);
      versions.swap(next_versions);
      tail.push_back(t);
      if (int(tail.size()) >= depth_) tail.erase(tail.begin());
    }
  }

  int materialize(const std::vector<int64_t>& tail, size_t k) {
    int node = kRoot;
    for (size_t i = tail.size() - k; i < tail.size(); ++i) {
      int nx = child(node, tail[i]);
      if (nx < 0) {
        nx = add_child(node, tail[i]);
        tot_[node] += 1;
        auto top = tops_.find(node);
        if (top != tops_.end()) update_top(top->second, nx);
      } else {
        touch(nx);
      }
      node = nx;
    }
    return node;
  }

  void evict_one() {
    int n;
    for (;;) {
      n = nxt_[kRoot];
      if (n == kRoot) throw std::logic_error("ngram trie: the LRU is empty but the trie is full");
      const int q = nxt_[n];
      nxt_[kRoot] = q;
      prv_[q] = kRoot;
      prv_[n] = nxt_[n] = -1;
      if (nk_[n] == 0) break;
      // a parked non-leaf: out of the queue until touched or childless
    }
    const int p = par_[n];
    table_.erase(p, tok_[n]);
    sib_unlink(p, n);
    tot_[p] -= cnt_[n];
    auto top = tops_.find(p);
    if (top != tops_.end()) {
      auto at = std::find(top->second.begin(), top->second.end(), n);
      if (at != top->second.end()) {
        if (int(top->second.size()) < max_breadth_)
          top->second.erase(at);  // still holds every remaining child
        else
          tops_.erase(top);
      }
    }
    tops_.erase(n);
    ver_[n] += 1;
    par_[n] = -1;
    free_.push_back(n);
    --num_nodes_;
    if (nk_[p] == 0 && p != kRoot && prv_[p] < 0) to_front(p);
  }

  void drop_subtree(int n) {
    const int p = par_[n];
    table_.erase(p, tok_[n]);
    sib_unlink(p, n);
    tot_[p] -= std::max<int64_t>(cnt_[n], 0);
    tops_.erase(p);
    std::vector<int> stack{n};
    while (!stack.empty()) {
      const int m = stack.back();
      stack.pop_back();
      for (int c = fk_[m]; c >= 0; c = sn_[c]) {
        table_.erase(m, tok_[c]);
        stack.push_back(c);
      }
      if (prv_[m] >= 0) {  // queued: unlink
        const int a = prv_[m], b = nxt_[m];
        nxt_[a] = b;
        prv_[b] = a;
      }
      prv_[m] = nxt_[m] = -1;
      fk_[m] = lk_[m] = -1;
      nk_[m] = 0;
      sp_[m] = sn_[m] = -1;
      tops_.erase(m);
      ver_[m] += 1;
      par_[m] = -1;
      cnt_[m] = tot_[m] = 0;
      free_.push_back(m);
      --num_nodes_;
    }
    if (nk_[p] == 0 && p != kRoot && prv_[p] < 0) to_front(p);
  }

  // the top max_bfs_breadth children by (count, recency), most first
  std::vector<int> fresh_top(int node) const {
    std::vector<std::pair<int64_t, int>> keyed;  // (count, recency index)
    std::vector<int> kids;
    for (int c = fk_[node]; c >= 0; c = sn_[c]) {
      keyed.emplace_back(cnt_[c], int(kids.size()));
      kids.push_back(c);
    }
    const size_t k = std::min(keyed.size(), size_t(max_breadth_));
    std::partial_sort(keyed.begin(), keyed.begin() + k, keyed.end(),
                      [](const auto& a, const auto& b) { return a > b; });
    std::vector<int> top(k);
    for (size_t i = 0; i < k; ++i) top[i] = kids[keyed[i].second];
    return top;
  }

  const std::vector<int>& top_children(int node) {
    auto it = tops_.find(node);
    if (it == tops_.end()) it = tops_.emplace(node, fresh_top(node)).first;
    return it->second;
  }

  struct HeapItem {
    double p;
    int64_t seq;
    int parent;
    int node;
  };
  struct HeapLess {  // std heaps pop the largest: the highest p, then the earliest seq
    bool operator()(const HeapItem& a, const HeapItem& b) const {
      return a.p < b.p || (a.p == b.p && a.seq > b.seq);
    }
  };

  // specserve/speculative/ngram_context.py: grow_best_first over this trie
  Scored grow_best_first(int64_t root, int start, int64_t limit, double min_prob) {
    std::vector<int64_t> tokens{root};
    std::vector<int> parents{-1};
    std::vector<double> probs{1.0};
    double score = 0.0;
    std::vector<HeapItem> heap;
    int64_t seq = 0;
    int idx = 0, handle = start;
    double prob = 1.0;
    for (;;) {
      if (nk_[handle] > 0 && tot_[handle] > 0) {
        const double scale = prob / double(tot_[handle]);
        for (const int c : top_children(handle)) {
          const double p = double(cnt_[c]) * scale;
          if (p >= min_prob) {
            heap.push_back({p, seq++, idx, c});
            std::push_heap(heap.begin(), heap.end(), HeapLess());
          }
        }
      }
      if (heap.empty() || int64_t(tokens.size()) > limit) break;
      std::pop_heap(heap.begin(), heap.end(), HeapLess());
      const HeapItem it = heap.back();
      heap.pop_back();
      idx = int(tokens.size());
      tokens.push_back(tok_[it.node]);
      parents.push_back(it.parent);
      handle = it.node;
      prob = it.p;
      probs.push_back(prob);
      score += prob;
      if (int64_t(tokens.size()) > limit) break;
    }
    return {tokens, parents, probs, score, 0};
  }

  // a tree node's child with token t, or -1 (trees hold a few dozen nodes: a linear scan)
  static int tree_child(const std::vector<std::vector<std::pair<int64_t, int>>>& kids, int idx,
                        int64_t t) {
    for (const auto& kv : kids[idx])
      if (kv.first == t) return kv.second;
    return -1;
  }

  void build_bfs(Matcher& mt, int node, int m, std::vector<int64_t>& tokens,
                 std::vector<int>& parents, int64_t budget) {
    std::vector<std::vector<std::pair<int64_t, int>>> tree_kids(1);
    std::deque<std::tuple<int, int, int>> queue;  // tree node, trie node, breadth index
    do {
      queue.clear();
      queue.emplace_back(0, node, m - 1);
      while (!queue.empty()) {
        const auto [idx, tn, bi] = queue.front();
        queue.pop_front();
        if (nk_[tn] == 0) continue;
        int b = breadth_.at(size_t(bi));
        for (int c = lk_[tn]; c >= 0; c = sp_[c]) {  // most recent first
          if (b == 0) break;
          --b;
          const int64_t t = tok_[c];
          int pos = tree_child(tree_kids, idx, t);
          if (pos < 0) {
            pos = int(tokens.size());
            tokens.push_back(t);
            parents.push_back(idx);
            tree_kids.emplace_back();
            tree_kids[idx].emplace_back(t, pos);
            if (pos + 1 >= budget) return;
          }
          queue.emplace_back(pos, c, bi + 1);
        }
      }
    } while (mt.next(node, m));
  }

  void build_prob(Matcher& mt, int node, int m, std::vector<int64_t>& tokens,
                  std::vector<int>& parents, int64_t budget) {
    std::vector<std::vector<std::pair<int64_t, int>>> tree_kids(1);
    std::vector<HeapItem> heap;  // (p, seq, tree parent, trie node)
    int64_t seq = 0;
    do {
      int idx = 0, tn = node;
      double prob = 1.0;
      for (;;) {
        if (nk_[tn] > 0) {
          const double scale = prob / double(tot_[tn]);
          for (const int c : top_children(tn)) {
            heap.push_back({double(cnt_[c]) * scale, seq++, idx, c});
            std::push_heap(heap.begin(), heap.end(), HeapLess());
          }
        }
        if (heap.empty()) break;
        std::pop_heap(heap.begin(), heap.end(), HeapLess());
        const HeapItem it = heap.back();
        heap.pop_back();
        tn = it.node;
        const int64_t t = tok_[tn];
        idx = tree_child(tree_kids, it.parent, t);
        if (idx < 0) {
          idx = int(tokens.size());
          tokens.push_back(t);
          parents.push_back(it.parent);
          tree_kids.emplace_back();
          tree_kids[it.parent].emplace_back(t, idx);
          if (idx + 1 >= budget) return;
        }
        prob = it.p;
      }
    } while (mt.next(node, m));
  }

  const int64_t capacity_;
  const int depth_, min_match_, max_breadth_;
  const std::vector<int> breadth_;
  const bool prob_;
  const int64_t max_states_;

  // per node (id 0 = the root); ids of evicted nodes are reused, versions tell them apart
  std::vector<int64_t> tok_, cnt_, tot_, ver_;
  std::vector<int> par_, prv_, nxt_, fk_, lk_, sp_, sn_, nk_;
  std::vector<int> free_;
  ChildTable table_;
  std::unordered_map<int, std::vector<int>> tops_;
  int64_t num_nodes_ = 0;
  int64_t allocated_ = 0;  // ids ever handed out: the next never-used one
  int last_match_ = 0;
  std::unordered_map<std::string, ReqState> states_;
  std::list<std::string> order_;  // request states, least recently extended first
};

}  // namespace

void register_ngram_trie(py::module_& m) {
  py::class_<NgramTrie>(m, "NgramTrie")
      .def(py::init<int64_t, int, int, int, std::vector<int>, bool, int64_t>(),
           py::arg("capacity"), py::arg("depth"), py::arg("min_match_window"),
           py::arg("max_bfs_breadth"), py::arg("breadth"), py::arg("prob"),
           py::arg("max_tracked_requests"))
      .def_property_readonly("num_nodes", &NgramTrie::num_nodes)
      .def_property_readonly("reserved_bytes", &NgramTrie::reserved_bytes)
      .def_property_readonly("last_match_len", &NgramTrie::last_match_len)
      .def("count", &NgramTrie::count)
      .def("insert", &NgramTrie::insert)
      .def("extend", &NgramTrie::extend)
      .def("release", &NgramTrie::release)
      .def("remove", &NgramTrie::remove)
      .def("draft_scored", &NgramTrie::draft_scored)
      .def("draft_lists", &NgramTrie::draft_lists)
      .def("dump", &NgramTrie::dump)
      .def("check_integrity", &NgramTrie::check_integrity);
}

}  // namespace specserve
