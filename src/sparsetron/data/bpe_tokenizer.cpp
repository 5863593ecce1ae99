#include "sparsetron/data/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>

#include "sparsetron/core/error.h"

namespace sparsetron {

// GPT-2's pattern, which the ByteLevel pre-tokenizer applies when `use_regex` is true.
constexpr const char* kGpt2Split =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct BpeTokenizer::Regex {
    pcre2_code* code = nullptr;
    explicit Regex(const std::string& pattern) {
        int err = 0;
        PCRE2_SIZE at = 0;
        code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                             PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &at, nullptr);
        if (!code) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(err, msg, sizeof msg);
            throw Error(cat("tokenizer: the split pattern does not compile at offset ", at, ": ",
                            reinterpret_cast<const char*>(msg)));
        }
        pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter
    }
    ~Regex() { pcre2_code_free(code); }
    // Pieces of `text`: every match and every stretch between matches ("Isolated").
    void split(const std::string& text, std::vector<std::string>& out) const {
        pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
        size_t pos = 0, gap = 0;
        while (pos <= text.size()) {
            const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                                       pos, 0, md, nullptr);
            if (rc < 0) break;
            const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
            const size_t b = ov[0], e = ov[1];
            if (b > gap) out.push_back(text.substr(gap, b - gap));
            if (e > b) out.push_back(text.substr(b, e - b));
            gap = e;
            if (e == b) {  // an empty match: step one UTF-8 character on
                pos = e + 1;
                while (pos < text.size() && (uint8_t(text[pos]) & 0xC0) == 0x80) ++pos;
            } else {
                pos = e;
            }
        }
        if (gap < text.size()) out.push_back(text.substr(gap));
        pcre2_match_data_free(md);
    }
};

namespace {

std::string utf8(uint32_t cp) {
    std::string s;
    if (cp < 0x80) {
        s += char(cp);
    } else if (cp < 0x800) {
        s += char(0xC0 | (cp >> 6));
        s += char(0x80 | (cp & 0x3F));
    } else {
        s += char(0xE0 | (cp >> 12));
        s += char(0x80 | ((cp >> 6) & 0x3F));
        s += char(0x80 | (cp & 0x3F));
    }
    return s;
}

const nlohmann::json& need(const nlohmann::json& j, const char* key, const std::string& where) {
    ST_CHECK(j.contains(key), where, ": no '", key, "'");
    return j.at(key);
}

}  // namespace

BpeTokenizer::BpeTokenizer(const std::string& path) {
    static std::atomic<uint64_t> instances{0};
    instance_ = ++instances;
    std::ifstream in(path);
    ST_CHECK(in.good(), "tokenizer: cannot read '", path, "'");
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(in);
    } catch (const std::exception& e) {
        throw Error(cat(path, ": not JSON (", e.what(), ")"));
    }
    // GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the
    // others take code points from 256 on, in byte order.
    for (int b = 0, n = 0; b < 256; ++b) {
        const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        byte_chars_[b] = utf8(printable ? uint32_t(b) : uint32_t(256 + n++));
    }
    ST_CHECK(!j.contains("normalizer") || j["normalizer"].is_null(), path,
             ": a normalizer is not supported (byte-level BPE tokenizers have none)");
    const nlohmann::json& model = need(j, "model", path);
    ST_CHECK(model.value("type", std::string("BPE")) == "BPE", path, ": model type '",
             model.value("type", std::string()), "' is not supported (BPE only)");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
        ST_CHECK(!model.contains(k) || model[k].is_null() || model[k] == "", path, ": model.", k,
                 " is not supported");
    ST_CHECK(!model.value("byte_fallback", false), path, ": byte_fallback is not supported");
    ignore_merges_ = model.value("ignore_merges", false);
    for (const auto& [tok, id] : need(model, "vocab", path).items()) {
        vocab_[tok] = id.get<int32_t>();
        vocab_size_ = std::max<int64_t>(vocab_size_, id.get<int64_t>() + 1);
    }
    // Merges as id pairs (HF's BPE refuses a merge whose parts or result are not in the
    // vocabulary).
    auto vocab_id = [&](const std::string& t) {
        const auto it = vocab_.find(t);
        ST_CHECK(it != vocab_.end(), path, ": merge token '", t, "' is not in the vocabulary");
        return it->second;
    };
    int32_t rank = 0;
    for (const auto& m : need(model, "merges", path)) {
        std::string a, b;
        if (m.is_string()) {
            const std::string key = m.get<std::string>();
            const size_t space = key.find(' ');
            ST_CHECK(space != std::string::npos && key.find(' ', space + 1) == std::string::npos,
                     path, ": merge \"", key, "\" is not \"a b\"");
            a = key.substr(0, space), b = key.substr(space + 1);
        } else {
            ST_CHECK(m.is_array() && m.size() == 2, path, ": a merge is \"a b\" or [a, b]");
            a = m[0].get<std::string>(), b = m[1].get<std::string>();
        }
        merges_.emplace(pair_key(vocab_id(a), vocab_id(b)), Merge{rank++, vocab_id(a + b)});
    }
    for (int b = 0; b < 256; ++b) {
        const auto it = vocab_.find(byte_chars_[b]);
        byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
    }
    if (model.contains("unk_token") && model["unk_token"].is_string())
        unk_ = token_id(model["unk_token"].get<std::string>());
    if (j.contains("added_tokens"))
        for (const auto& a : j["added_tokens"]) {
            ST_CHECK(!a.value("single_word", false), path, ": added token '",
                     a.value("content", std::string()), "' has single_word, not supported");
            added_.push_back({a.at("content").get<std::string>(), a.at("id").get<int32_t>(),
                              a.value("lstrip", false), a.value("rstrip", false)});
            vocab_size_ = std::max<int64_t>(vocab_size_, a.at("id").get<int64_t>() + 1);
        }
    // Longest first: the leftmost match takes the longest content there.
    std::stable_sort(added_.begin(), added_.end(), [](const Added& a, const Added& b) {
        return a.content.size() > b.content.size();
    });
    // Pre-tokenizer: ByteLevel (its own regex), or Sequence [Split(regex, Isolated), ByteLevel].
    const nlohmann::json pre = j.value("pre_tokenizer", nlohmann::json());
    std::vector<nlohmann::json> steps;
    if (pre.is_object() && pre.value("type", std::string()) == "Sequence")
        for (const auto& s : pre.at("pretokenizers")) steps.push_back(s);
    else if (!pre.is_null())
        steps.push_back(pre);
    bool byte_level = false;
    for (const auto& s : steps) {
        const std::string type = s.value("type", std::string());
        if (type == "Split") {
            ST_CHECK(!split_ && !byte_level, path, ": one Split before ByteLevel is supported");
            ST_CHECK(s.value("behavior", std::string()) == "Isolated" && !s.value("invert", false),
                     path, ": Split must be Isolated and not inverted");
            const auto& pat = need(s, "pattern", path);
            ST_CHECK(pat.contains("Regex"), path, ": Split needs a Regex pattern");
            split_ = std::make_unique<Regex>(pat["Regex"].get<std::string>());
            split_before_byte_level_ = true;
        } else if (type == "ByteLevel") {
            byte_level = true;
            add_prefix_space_ = s.value("add_prefix_space", false);
            if (s.value("use_regex", true)) {
                ST_CHECK(!split_, path, ": ByteLevel with use_regex after a Split");
                split_ = std::make_unique<Regex>(kGpt2Split);
            }
        } else {
            throw Error(cat(path, ": pre-tokenizer '", type,
                            "' is not supported (ByteLevel, or Split then ByteLevel)"));
        }
    }
    ST_CHECK(byte_level, path, ": not a byte-level tokenizer (no ByteLevel pre-tokenizer)");
    // Post-processor: TemplateProcessing's single sequence, or none / ByteLevel (no tokens).
    const nlohmann::json post = j.value("post_processor", nlohmann::json());
    std::vector<nlohmann::json> posts;
    if (post.is_object() && post.value("type", std::string()) == "Sequence")
        for (const auto& p : post.at("processors")) posts.push_back(p);
    else if (!post.is_null())
        posts.push_back(post);
    for (const auto& p : posts) {
        const std::string type = p.value("type", std::string());
        if (type == "ByteLevel") continue;
        ST_CHECK(type == "TemplateProcessing", path, ": post-processor '", type,
                 "' is not supported (TemplateProcessing, ByteLevel)");
        bool after = false;
        for (const auto& piece : p.at("single")) {
            if (piece.contains("Sequence")) {
                after = true;
                continue;
            }
            const std::string name = piece.at("SpecialToken").at("id").get<std::string>();
            for (const auto& id : p.at("special_tokens").at(name).at("ids"))
                (after ? suffix_ : prefix_).push_back(id.get<int32_t>());
        }
    }
}

BpeTokenizer::~BpeTokenizer() = default;

int32_t BpeTokenizer::token_id(const std::string& token) const {
    for (const Added& a : added_)
        if (a.content == token) return a.id;
    const auto it = vocab_.find(token);
    return it == vocab_.end() ? -1 : it->second;
}

void BpeTokenizer::encode_piece(const std::string& piece, std::vector<int32_t>& out) const {
    // Pieces repeat (words): each thread remembers the ids of those it has encoded.
    struct Cache {
        uint64_t instance = 0;
        std::unordered_map<std::string, std::vector<int32_t>> ids;
    };
    thread_local Cache cache;
    constexpr size_t kCachedPieceBytes = 64, kCacheEntries = 1 << 18;
    if (cache.instance != instance_ || cache.ids.size() >= kCacheEntries) {
        cache.ids.clear();
        cache.instance = instance_;
    }
    if (piece.size() <= kCachedPieceBytes) {
        const auto hit = cache.ids.find(piece);
        if (hit != cache.ids.end()) {
            out.insert(out.end(), hit->second.begin(), hit->second.end());
            return;
        }
    }
    const size_t first = out.size();
    merge_piece(piece, out);
    if (piece.size() <= kCachedPieceBytes)
        cache.ids.emplace(piece,
                          std::vector<int32_t>(out.begin() + std::ptrdiff_t(first), out.end()));
}

void BpeTokenizer::merge_piece(const std::string& piece, std::vector<int32_t>& out) const {
    if (ignore_merges_) {
        std::string mapped;
        for (unsigned char b : piece) mapped += byte_chars_[b];
        const auto it = vocab_.find(mapped);
        if (it != vocab_.end()) {
            out.push_back(it->second);
            return;
        }
    }
    // Symbols: one per byte (each byte's stand-in character), linked left to right. Merge the
    // lowest-ranked adjacent pair, leftmost first, until no pair has a merge: a heap of candidate
    // pairs ordered by (rank, position of the left symbol); a candidate whose symbols have since
    // changed is stale and skipped.
    struct Symbol {
        int32_t id, prev, next;
    };
    std::vector<Symbol> sym(piece.size());
    for (size_t i = 0; i < piece.size(); ++i) {
        const int32_t id = byte_ids_[uint8_t(piece[i])];
        ST_CHECK(id >= 0 || unk_ >= 0, "tokenizer: '", byte_chars_[uint8_t(piece[i])],
                 "' is not in the vocabulary and there is no unk_token");
        sym[i] = {id >= 0 ? id : unk_, int32_t(i) - 1, i + 1 < piece.size() ? int32_t(i + 1) : -1};
    }
    struct Candidate {
        int32_t rank, pos, left, right, merged;
        bool operator>(const Candidate& o) const {
            return rank != o.rank ? rank > o.rank : pos > o.pos;
        }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
    auto consider = [&](int32_t pos) {
        if (pos < 0 || sym[size_t(pos)].next < 0) return;
        const Symbol& l = sym[size_t(pos)];
        const auto it = merges_.find(pair_key(l.id, sym[size_t(l.next)].id));
        if (it != merges_.end())
            heap.push({it->second.rank, pos, l.id, sym[size_t(l.next)].id, it->second.id});
    };
    for (int32_t i = 0; i < int32_t(sym.size()); ++i) consider(i);
    while (!heap.empty()) {
        const Candidate c = heap.top();
        heap.pop();
        Symbol& l = sym[size_t(c.pos)];
        if (l.id != c.left || l.next < 0 || sym[size_t(l.next)].id != c.right) continue;
        const int32_t gone = l.next;
        l.id = c.merged;
        l.next = sym[size_t(gone)].next;
        if (l.next >= 0) sym[size_t(l.next)].prev = c.pos;
        sym[size_t(gone)].id = -1;  // no candidate names a removed symbol's position again
        consider(l.prev);
        consider(c.pos);
    }
    for (int32_t i = sym.empty() ? -1 : 0; i >= 0; i = sym[size_t(i)].next)
        out.push_back(sym[size_t(i)].id);
}

void BpeTokenizer::encode_plain(const std::string& text, std::vector<int32_t>& out) const {
    if (text.empty()) return;
    // ByteLevel's add_prefix_space: a space before each piece it receives that has none (the
    // text between added tokens with its own regex; each Split piece after a Split).
    auto spaced = [&](const std::string& t) {
        return add_prefix_space_ && t[0] != ' ' ? " " + t : t;
    };
    std::vector<std::string> pieces;
    if (split_ && split_before_byte_level_) {
        split_->split(text, pieces);
        for (std::string& p : pieces) p = spaced(p);
    } else if (split_) {
        split_->split(spaced(text), pieces);
    } else {
        pieces.push_back(spaced(text));
    }
    for (const std::string& p : pieces) encode_piece(p, out);
}

std::vector<int32_t> BpeTokenizer::encode(const std::string& text_in, bool add_special) const {
    std::vector<int32_t> out;
    if (add_special) out = prefix_;
    const std::string& text = text_in;
    // Added tokens first: the leftmost occurrence of any, the longest there; lstrip / rstrip take
    // the whitespace next to it into the token.
    size_t pos = 0;
    while (pos < text.size()) {
        size_t best = std::string::npos;
        const Added* hit = nullptr;
        for (const Added& a : added_) {
            const size_t at = text.find(a.content, pos);
            if (at != std::string::npos && (best == std::string::npos || at < best))
                best = at, hit = &a;
        }
        if (!hit) break;
        size_t lo = best, hi = best + hit->content.size();
        if (hit->lstrip)
            while (lo > pos && std::isspace(uint8_t(text[lo - 1]))) --lo;
        if (hit->rstrip)
            while (hi < text.size() && std::isspace(uint8_t(text[hi]))) ++hi;
        encode_plain(text.substr(pos, lo - pos), out);
        out.push_back(hit->id);
        pos = hi;
    }
    encode_plain(text.substr(pos), out);
    if (add_special) out.insert(out.end(), suffix_.begin(), suffix_.end());
    return out;
}

}  // namespace sparsetron
