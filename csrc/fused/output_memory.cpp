/* Output memory for the fused primitives: MLX's stream-ordered allocator,
 * found in libmlx.so's symbol table where the loaded MLX is the build
 * compiled against, else its public one (see output_memory.h for why). */
#include "fused/output_memory.h"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>

#include "fused/mlx_build_identity.h"
#include "mlx/backend/common/utils.h"

namespace mlx_dualnorm_fused {

namespace {

namespace mx = mlx::core;

/* mlx::core::cu::malloc_async(size_t, mlx::core::cu::CommandEncoder&), as
 * mlx/allocator.h declares it. */
using StreamOrderedMalloc = mx::allocator::Data (*)(size_t, mx::cu::CommandEncoder&);
constexpr const char kStreamOrderedMallocSymbol[] =
    "_ZN3mlx4core2cu12malloc_asyncEmRNS1_14CommandEncoderE";

/* The exported function whose address anchors the lookup:
 * mlx::core::allocator::allocator(). */
constexpr const char kAnchorSymbol[] = "_ZN3mlx4core9allocator9allocatorEv";

/* A read-only mapping of a whole file, unmapped (and its descriptor
 * closed) when it goes out of scope, on every path. */
class MappedFile {
 public:
  explicit MappedFile(const char* path) {
    const int descriptor = open(path, O_RDONLY | O_CLOEXEC);
    if (descriptor < 0) {
      return;
    }
    struct stat status {};
    if (fstat(descriptor, &status) == 0 && status.st_size > 0) {
      void* mapped = mmap(nullptr, static_cast<size_t>(status.st_size), PROT_READ, MAP_PRIVATE,
                          descriptor, 0);
      if (mapped != MAP_FAILED) {
        data_ = static_cast<const unsigned char*>(mapped);
        size_ = static_cast<size_t>(status.st_size);
      }
    }
    close(descriptor);
  }
  ~MappedFile() {
    if (data_ != nullptr) {
      munmap(const_cast<unsigned char*>(data_), size_);
    }
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  /* `count` objects of T at `offset`, or null where they overrun the file. */
  template <typename T>
  const T* at(uint64_t offset, uint64_t count = 1) const {
    if (data_ == nullptr || offset > size_ || count > (size_ - offset) / sizeof(T)) {
      return nullptr;
    }
    return reinterpret_cast<const T*>(data_ + offset);
  }

 private:
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

/* The values (addresses relative to the load base) of two defined
 * functions in a 64-bit ELF file's .symtab; 0 where not found. */
struct SymbolValues {
  uint64_t wanted = 0;
  uint64_t anchor = 0;
};

SymbolValues find_function_values(const MappedFile& file, const char* wanted,
                                  const char* anchor) {
  SymbolValues found;
  const auto* header = file.at<Elf64_Ehdr>(0);
  if (header == nullptr || std::memcmp(header->e_ident, ELFMAG, SELFMAG) != 0 ||
      header->e_ident[EI_CLASS] != ELFCLASS64 || header->e_shentsize != sizeof(Elf64_Shdr)) {
    return found;
  }
  const auto* sections = file.at<Elf64_Shdr>(header->e_shoff, header->e_shnum);
  if (sections == nullptr) {
    return found;
  }
  for (unsigned index = 0; index < header->e_shnum; ++index) {
    const Elf64_Shdr& table = sections[index];
    if (table.sh_type != SHT_SYMTAB || table.sh_entsize != sizeof(Elf64_Sym) ||
        table.sh_link >= header->e_shnum) {
      continue;
    }
    const Elf64_Shdr& names = sections[table.sh_link];
    const auto* symbols = file.at<Elf64_Sym>(table.sh_offset, table.sh_size / sizeof(Elf64_Sym));
    const auto* text = file.at<char>(names.sh_offset, names.sh_size);
    if (symbols == nullptr || text == nullptr) {
      continue;
    }
    for (uint64_t i = 0; i < table.sh_size / sizeof(Elf64_Sym); ++i) {
      const Elf64_Sym& symbol = symbols[i];
      if (ELF64_ST_TYPE(symbol.st_info) != STT_FUNC || symbol.st_shndx == SHN_UNDEF ||
          symbol.st_name >= names.sh_size) {
        continue;
      }
      const char* name = text + symbol.st_name;
      // The string table ends in NUL (ELF), so strcmp stays inside it.
      if (std::strcmp(name, wanted) == 0) {
        found.wanted = symbol.st_value;
      } else if (std::strcmp(name, anchor) == 0) {
        found.anchor = symbol.st_value;
      }
    }
  }
  return found;
}

/* MLX's stream-ordered allocator, or null. Looked for only in the very
 * MLX build compiled against (the symbol's signature is that build's
 * header's). The anchor's address, as the dynamic linker resolved it for
 * this module, names the loaded libmlx.so and its base; the table's value
 * for the anchor must land on that same address, or the table is not the
 * loaded library's and is not used. */
StreamOrderedMalloc look_up_stream_ordered_malloc() {
  if (!mlx_dualnorm_mlx_build_matches()) {
    return nullptr;
  }
  void* anchor_address = reinterpret_cast<void*>(&mx::allocator::allocator);
  Dl_info library{};
  if (dladdr(anchor_address, &library) == 0 || library.dli_fname == nullptr ||
      library.dli_fbase == nullptr) {
    return nullptr;
  }
  const MappedFile file(library.dli_fname);
  const SymbolValues values = find_function_values(file, kStreamOrderedMallocSymbol, kAnchorSymbol);
  const auto* base = static_cast<const char*>(library.dli_fbase);
  if (values.wanted == 0 || values.anchor == 0 || base + values.anchor != anchor_address) {
    return nullptr;
  }
  return reinterpret_cast<StreamOrderedMalloc>(const_cast<char*>(base + values.wanted));
}

/* Looked up once per process (a function-local static: thread-safe). */
StreamOrderedMalloc stream_ordered_malloc() {
  static const StreamOrderedMalloc found = look_up_stream_ordered_malloc();
  return found;
}

/* How many arrays hold the node of `input` (the use count of the
 * ArrayDesc its one member points to). MLX keeps that pointer private and
 * reads the count only inside is_donatable, which wants it to be 1; the
 * layout read here (an array is exactly one shared_ptr) is checked at
 * compile time, and at run time, once, that the loaded MLX is the build
 * compiled against and that the reading works on a probe
 * (node_references_readable), before anything relies on it. */
long node_references(const mx::array& input) {
  static_assert(sizeof(mx::array) == sizeof(std::shared_ptr<void>),
                "mlx::core::array is expected to hold exactly one shared_ptr");
  return reinterpret_cast<const std::shared_ptr<void>&>(input).use_count();
}

/* Whether node_references may be trusted: only in the very MLX build
 * compiled against, and only where it reads what it should there: 1 for a
 * new array, 2 once a second array holds the same node, 1 again when that
 * one lets go. If not, no buffer is ever taken (every write copies:
 * slower, never wrong). */
bool node_references_readable() {
  static const bool readable = [] {
    if (!mlx_dualnorm_mlx_build_matches()) {
      return false;
    }
    const mx::array probe(0.0f);
    const long alone = node_references(probe);
    long shared = 0;
    {
      const mx::array second = probe;
      shared = node_references(probe);
    }
    return alone == 1 && shared == 2 && node_references(probe) == 1;
  }();
  return readable;
}

/* How much larger than the output a donated buffer may be: MLX's own
 * limit (backend/common/utils.h, is_donatable), so that a write keeps an
 * oversized buffer no more often than MLX's SliceUpdate would. */
constexpr size_t kDonationSlack = 16384;

/* Whether the node being evaluated may write `output` over `input`'s
 * memory: see take_buffer_or_allocate; the shapes are the caller's to
 * compare (only the element count is checked here). */
bool donatable_to(const mx::array& input, const mx::array& output, size_t node_outputs) {
  const auto& memory = input.data_shared_ptr();
  return node_references_readable() &&
         node_references(input) == static_cast<long>(node_outputs) && memory != nullptr &&
         memory.use_count() == 1 && memory->is_owned() && input.flags().row_contiguous &&
         input.data_size() == input.size() && input.size() == output.size() &&
         input.dtype() == output.dtype() &&
         input.buffer_size() <= output.nbytes() + kDonationSlack;
}

} // namespace

bool take_buffer_or_allocate(const mx::array& buffer, mx::array& output, size_t node_outputs,
                             mx::cu::CommandEncoder& encoder) {
  if (buffer.shape() == output.shape() && donatable_to(buffer, output, node_outputs)) {
    output.copy_shared_buffer(buffer);
    return true;
  }
  output.set_data(output_memory(output.nbytes(), encoder));
  return false;
}

void take_input_memory_or_allocate(const mx::array& input, mx::array& output,
                                   const mx::Strides& strides, size_t node_outputs,
                                   mx::cu::CommandEncoder& encoder) {
  auto [unbroadcast_size, row_contiguous, col_contiguous] =
      mx::check_contiguity(output.shape(), strides);
  mx::array::Flags flags{};
  flags.contiguous = unbroadcast_size == output.size();
  flags.row_contiguous = row_contiguous;
  flags.col_contiguous = col_contiguous;
  if (donatable_to(input, output, node_outputs)) {
    output.copy_shared_buffer(input, strides, flags, output.size());
  } else {
    output.set_data(output_memory(output.nbytes(), encoder), output.size(), strides, flags);
  }
}

mx::allocator::Data output_memory(size_t bytes, mx::cu::CommandEncoder& encoder) {
  if (StreamOrderedMalloc allocate = stream_ordered_malloc()) {
    return allocate(bytes, encoder);
  }
  return mx::allocator::malloc(bytes);
}

bool outputs_use_stream_ordered_pool() {
  return stream_ordered_malloc() != nullptr;
}

} // namespace mlx_dualnorm_fused
