// tools/npy.cc: the .npy reader and writer (see npy.h). The header is a Python dict
// literal; this parser accepts exactly the three keys NumPy writes, in any order.
#include "npy.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

namespace vpce::npy {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicBytes = 6;
constexpr int kMaxDims = 32;

Status bad(const std::string& name, const std::string& what) { return {Code::kInvalidArgument, name + ": " + what}; }

// A cursor over the header text.
class HeaderParser {
 public:
  explicit HeaderParser(const std::string& text) : text_(text) {}

  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool eat(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool peek(char c) {
    skip_space();
    return pos_ < text_.size() && text_[pos_] == c;
  }
  bool string_literal(std::string* out) {
    skip_space();
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) return false;
    const char quote = text_[pos_++];
    const std::size_t end = text_.find(quote, pos_);
    if (end == std::string::npos) return false;
    *out = text_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return true;
  }
  bool word(std::string* out) {
    skip_space();
    const std::size_t start = pos_;
    while (pos_ < text_.size() && std::isalpha(static_cast<unsigned char>(text_[pos_]))) ++pos_;
    *out = text_.substr(start, pos_ - start);
    return !out->empty();
  }
  // A non-negative integer; false if there is none. `*overflow` is set when its digits
  // (kept in `*digits`) exceed int64.
  bool integer(int64_t* out, bool* overflow, std::string* digits) {
    skip_space();
    const std::size_t start = pos_;
    int64_t value = 0;
    *overflow = false;
    while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
      *overflow = *overflow || __builtin_mul_overflow(value, 10, &value) ||
                  __builtin_add_overflow(value, text_[pos_] - '0', &value);
      ++pos_;
    }
    *digits = text_.substr(start, pos_ - start);
    if (pos_ < text_.size() && text_[pos_] == 'L') ++pos_;  // Python 2 long suffix
    *out = value;
    return pos_ > start;
  }
  bool at_end() {
    skip_space();
    return pos_ == text_.size();
  }

 private:
  const std::string& text_;
  std::size_t pos_ = 0;
};

bool dtype_from_descr(const std::string& text, Dtype* out) {
  static const struct {
    const char* text;
    Dtype dtype;
  } kKnown[] = {{"<f2", Dtype::kFloat16},
                {"<f4", Dtype::kFloat32},
                {"<f8", Dtype::kFloat64},
                {"<i4", Dtype::kInt32},
                {"<i8", Dtype::kInt64}};
  for (const auto& k : kKnown) {
    if (text == k.text) {
      *out = k.dtype;
      return true;
    }
  }
  return false;
}

Status parse_header(const std::string& text, const std::string& name, Dtype* dtype, std::vector<int64_t>* shape) {
  HeaderParser p(text);
  if (!p.eat('{')) return bad(name, "header: expected a dict literal starting with '{'");
  bool have_descr = false;
  bool have_order = false;
  bool have_shape = false;
  while (!p.eat('}')) {
    std::string key;
    if (!p.string_literal(&key) || !p.eat(':')) {
      return bad(name, "header: expected 'key': value pairs");
    }
    if (key == "descr") {
      std::string value;
      if (!p.string_literal(&value)) {
        return bad(name,
                   "dtype: expected a simple dtype's string for 'descr' (one of <f2 <f4 <f8 <i4 <i8), got "
                   "another value (a structured or sub-array dtype's list or tuple)");
      }
      if (!dtype_from_descr(value, dtype)) {
        return bad(name,
                   "dtype: expected one of <f2 <f4 <f8 <i4 <i8 (little-endian float16, "
                   "float32, float64, int32, int64), got '" +
                       value + "'");
      }
      have_descr = true;
    } else if (key == "fortran_order") {
      std::string value;
      if (!p.word(&value) || (value != "False" && value != "True")) {
        return bad(name, "header: expected True or False for 'fortran_order'");
      }
      if (value == "True") return bad(name, "fortran_order: expected False (C order), got True");
      have_order = true;
    } else if (key == "shape") {
      if (!p.eat('(')) return bad(name, "header: expected a tuple for 'shape'");
      shape->clear();
      while (!p.eat(')')) {
        int64_t dim = 0;
        bool overflow = false;
        std::string digits;
        if (!p.integer(&dim, &overflow, &digits)) return bad(name, "shape: expected non-negative integers");
        // Python 3 refuses 03 (numpy.load does) and takes 00.
        if (digits.size() > 1 && digits[0] == '0' && digits.find_first_not_of('0') != std::string::npos) {
          return bad(name, "shape: expected decimal integers without a leading zero, got " + digits);
        }
        if (overflow) {
          return bad(name, "shape: expected dimensions of at most 2^63 - 1, got " + digits + ", which overflows int64");
        }
        if (shape->size() == static_cast<std::size_t>(kMaxDims)) {
          return bad(name, "shape: expected at most 32 dimensions");
        }
        shape->push_back(dim);
        if (p.eat(',')) continue;
        if (!p.peek(')')) return bad(name, "shape: expected ',' or ')'");
        if (shape->size() == 1) {  // (24) is Python's 24, not a tuple: numpy refuses it too
          return bad(name, "shape: expected a tuple, (" + digits + ",) for one dimension, got (" + digits + ")");
        }
      }
      have_shape = true;
    } else {
      return bad(name, "header: unexpected key '" + key + "'");
    }
    if (!p.eat(',') && !p.peek('}')) return bad(name, "header: expected ',' or '}'");
  }
  if (!p.at_end()) return bad(name, "header: unexpected text after the dict");
  if (!have_descr || !have_order || !have_shape) {
    return bad(name, "header: expected the keys 'descr', 'fortran_order' and 'shape'");
  }
  return {};
}

}  // namespace

const char* descr(Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat16: return "<f2";
    case Dtype::kFloat32: return "<f4";
    case Dtype::kFloat64: return "<f8";
    case Dtype::kInt32: return "<i4";
    case Dtype::kInt64: return "<i8";
  }
  return "?";
}

int item_bytes(Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat16: return 2;
    case Dtype::kFloat32:
    case Dtype::kInt32: return 4;
    case Dtype::kFloat64:
    case Dtype::kInt64: return 8;
  }
  return 0;
}

int64_t Array::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// The magic and the header dictionary at the start of `bytes`; `header_end` is where the
// data begins. Needs only the first bytes of a file (up to the end of the header).
Status parse_prefix(const std::byte* bytes, std::size_t size, const std::string& name, Info* info,
                    std::size_t* header_end) {
  if (size < kMagicBytes + 4 || std::memcmp(bytes, kMagic, kMagicBytes) != 0) {
    return bad(name, "expected a .npy file (magic \\x93NUMPY), got something else");
  }
  const auto major = static_cast<unsigned>(bytes[6]);
  std::size_t header_len = 0;
  std::size_t header_start = 0;
  if (major == 1) {
    header_len = static_cast<std::size_t>(bytes[8]) | static_cast<std::size_t>(bytes[9]) << 8;
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) return bad(name, "truncated header");
    header_len = 0;
    for (int b = 3; b >= 0; --b) header_len = header_len << 8 | static_cast<std::size_t>(bytes[8 + b]);
    header_start = 12;
  } else {
    return bad(name, "format version: expected 1, 2 or 3, got " + std::to_string(major));
  }
  if (header_len > size - header_start) return bad(name, "truncated header");
  const std::string header(reinterpret_cast<const char*>(bytes) + header_start, header_len);
  if (Status s = parse_header(header, name, &info->dtype, &info->shape); !s.ok()) return s;
  uint64_t body = static_cast<uint64_t>(item_bytes(info->dtype));
  for (int64_t d : info->shape) {
    if (__builtin_mul_overflow(body, static_cast<uint64_t>(d), &body)) {
      return bad(name, "shape: the element count overflows");
    }
  }
  info->data_bytes = body;
  *header_end = header_start + header_len;
  return {};
}

// Opens `path` and parses its header; `file` is left open, `data_offset` where the data starts.
Status open_npy(const std::string& path, std::ifstream* file, Info* info, std::size_t* data_offset) {
  file->open(path, std::ios::binary);
  if (!*file) return {Code::kInvalidArgument, path + ": cannot open for reading"};
  file->seekg(0, std::ios::end);
  const auto size = static_cast<std::size_t>(file->tellg());
  file->seekg(0);
  // A header is at most 12 bytes of prefix plus a length of at most 2^32; real ones are short.
  std::vector<char> prefix(std::min<std::size_t>(size, std::size_t{1} << 20));
  file->read(prefix.data(), static_cast<std::streamsize>(prefix.size()));
  if (!*file) return {Code::kSystemError, path + ": read error"};
  if (Status s =
          parse_prefix(reinterpret_cast<const std::byte*>(prefix.data()), prefix.size(), path, info, data_offset);
      !s.ok()) {
    return s;
  }
  if (info->data_bytes != size - *data_offset) {
    return bad(path, "data: expected " + std::to_string(info->data_bytes) + " bytes for the shape and dtype, got " +
                         std::to_string(size - *data_offset));
  }
  return {};
}

}  // namespace

Status parse(const std::byte* bytes, std::size_t size, const std::string& name, Array* out) {
  Info info;
  std::size_t header_end = 0;
  if (Status s = parse_prefix(bytes, size, name, &info, &header_end); !s.ok()) return s;
  const std::size_t available = size - header_end;
  if (info.data_bytes != available) {
    return bad(name, "data: expected " + std::to_string(info.data_bytes) + " bytes for the shape and dtype, got " +
                         std::to_string(available));
  }
  Array array;
  array.dtype = info.dtype;
  array.shape = std::move(info.shape);
  const std::byte* data = bytes + header_end;
  array.data.assign(data, data + available);
  *out = std::move(array);
  return {};
}

Status read(const std::string& path, Array* out) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return {Code::kInvalidArgument, path + ": cannot open for reading"};
  std::vector<char> contents((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) return {Code::kSystemError, path + ": read error"};
  return parse(reinterpret_cast<const std::byte*>(contents.data()), contents.size(), path, out);
}

Status read_info(const std::string& path, Info* out) {
  std::ifstream file;
  std::size_t data_offset = 0;
  return open_npy(path, &file, out, &data_offset);
}

Status read_columns(const std::string& path, int64_t begin, int64_t end, Array* out) {
  std::ifstream file;
  Info info;
  std::size_t data_offset = 0;
  if (Status s = open_npy(path, &file, &info, &data_offset); !s.ok()) return s;
  if (info.shape.empty()) return bad(path, "shape: expected at least one dimension to take columns of, got ()");
  const int64_t columns = info.shape.back();
  if (begin < 0 || begin > end || end > columns) {
    return {Code::kInvalidArgument, path + ": columns: expected 0 <= begin <= end <= " + std::to_string(columns) +
                                        ", got [" + std::to_string(begin) + ", " + std::to_string(end) + ")"};
  }
  Array array;
  array.dtype = info.dtype;
  array.shape = info.shape;
  array.shape.back() = end - begin;
  const int64_t rows = columns == 0 ? 0 : static_cast<int64_t>(info.data_bytes / item_bytes(info.dtype)) / columns;
  const auto item = static_cast<std::size_t>(item_bytes(info.dtype));
  const std::size_t row_bytes = static_cast<std::size_t>(end - begin) * item;
  array.data.resize(static_cast<std::size_t>(rows) * row_bytes);
  for (int64_t i = 0; i < rows && row_bytes > 0; ++i) {
    const std::size_t offset = data_offset + (static_cast<std::size_t>(i * columns + begin)) * item;
    file.seekg(static_cast<std::streamoff>(offset));
    file.read(reinterpret_cast<char*>(array.data.data() + static_cast<std::size_t>(i) * row_bytes),
              static_cast<std::streamsize>(row_bytes));
    if (!file) return {Code::kSystemError, path + ": read error at row " + std::to_string(i)};
  }
  *out = std::move(array);
  return {};
}

std::string header(Dtype dtype, const std::vector<int64_t>& shape) {
  std::string text = "{'descr': '" + std::string(descr(dtype)) + "', 'fortran_order': False, 'shape': (";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    text += std::to_string(shape[d]);
    if (shape.size() == 1 || d + 1 < shape.size()) text += ",";
    if (d + 1 < shape.size()) text += " ";
  }
  text += "), }";
  // Pad with spaces so that magic + version + length + header + '\n' is a multiple of 64.
  const std::size_t unpadded = 10 + text.size() + 1;
  text.append((64 - unpadded % 64) % 64, ' ');
  text += '\n';
  std::string out(kMagic, kMagicBytes);
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(text.size() & 0xff);
  out += static_cast<char>(text.size() >> 8);
  return out + text;
}

uint64_t body_bytes(Dtype dtype, const std::vector<int64_t>& shape) {
  uint64_t bytes = static_cast<uint64_t>(item_bytes(dtype));
  for (int64_t d : shape) bytes *= static_cast<uint64_t>(d);
  return bytes;
}

std::vector<std::byte> serialize(Dtype dtype, const std::vector<int64_t>& shape, const void* data) {
  const std::string head = header(dtype, shape);
  const auto* p = static_cast<const std::byte*>(data);
  std::vector<std::byte> out(reinterpret_cast<const std::byte*>(head.data()),
                             reinterpret_cast<const std::byte*>(head.data()) + head.size());
  out.insert(out.end(), p, p + body_bytes(dtype, shape));
  return out;
}

}  // namespace vpce::npy
