// The docs stay readable and linked: every table cell of README.md and docs/ at most 300
// characters (detail goes into the text below a table), and every relative link resolves: the
// file exists and, with an anchor, one of its headings has that anchor (GitHub's rule: lower case,
// punctuation but '-' and '_' dropped, spaces as '-').
#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

const fs::path kRoot = SPARSETRON_SOURCE_DIR;

std::vector<fs::path> doc_files() {
    std::vector<fs::path> out{kRoot / "README.md"};
    for (const auto& e : fs::recursive_directory_iterator(kRoot / "docs"))
        if (e.path().extension() == ".md") out.push_back(e.path());
    return out;
}

std::vector<std::string> lines_of(const fs::path& p) {
    std::ifstream in(p);
    std::vector<std::string> out;
    for (std::string l; std::getline(in, l);) out.push_back(l);
    return out;
}

std::string anchor(const std::string& heading) {
    std::string out;
    for (unsigned char c : heading) {
        if (std::isalnum(c) || c >= 0x80)
            out += char(std::tolower(c));
        else if (c == ' ' || c == '-')
            out += '-';
        else if (c == '_')
            out += '_';
    }
    return out;
}

std::set<std::string> anchors_of(const fs::path& p) {
    std::set<std::string> out;
    bool fence = false;
    for (const std::string& l : lines_of(p)) {
        if (l.rfind("```", 0) == 0) fence = !fence;
        if (fence || l.empty() || l[0] != '#') continue;
        const size_t text = l.find_first_not_of('#');
        if (text == std::string::npos || l[text] != ' ') continue;
        std::string a = anchor(l.substr(text + 1));
        // GitHub numbers repeated headings' anchors: -1, -2, ...
        std::string unique = a;
        for (int i = 1; out.count(unique); ++i) unique = a + "-" + std::to_string(i);
        out.insert(unique);
    }
    return out;
}

}  // namespace

TEST(Docs, TableCellsStayShort) {
    for (const fs::path& f : doc_files()) {
        const auto lines = lines_of(f);
        for (size_t i = 0; i < lines.size(); ++i) {
            const std::string& l = lines[i];
            if (l.rfind("|", 0) != 0) continue;
            size_t at = 1;
            while (at < l.size()) {
                const size_t end = l.find('|', at);
                const std::string cell =
                    l.substr(at, end == std::string::npos ? std::string::npos : end - at);
                EXPECT_LE(cell.size(), 302u)
                    << fs::relative(f, kRoot).string() << ":" << i + 1 << ": a cell of "
                    << cell.size() << " characters (at most 300: detail goes below the table)";
                if (end == std::string::npos) break;
                at = end + 1;
            }
        }
    }
}

TEST(Docs, RelativeLinksResolve) {
    const std::regex link(R"(\]\(([^)\s]+)\))");
    int checked = 0;
    for (const fs::path& f : doc_files()) {
        const auto lines = lines_of(f);
        for (size_t i = 0; i < lines.size(); ++i) {
            for (std::sregex_iterator m(lines[i].begin(), lines[i].end(), link), e; m != e; ++m) {
                const std::string target = (*m)[1];
                if (target.find("://") != std::string::npos || target.rfind("mailto:", 0) == 0)
                    continue;
                const size_t hash = target.find('#');
                const std::string file = target.substr(0, hash);
                const fs::path p = file.empty() ? f : f.parent_path() / file;
                const std::string where =
                    fs::relative(f, kRoot).string() + ":" + std::to_string(i + 1) + ": " + target;
                ++checked;
                if (!fs::exists(p)) {
                    ADD_FAILURE() << where << ": no such file";
                    continue;
                }
                if (hash == std::string::npos || p.extension() != ".md") continue;
                EXPECT_TRUE(anchors_of(p).count(target.substr(hash + 1)))
                    << where << ": no such heading";
            }
        }
    }
    EXPECT_GT(checked, 20);
}
