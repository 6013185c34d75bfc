/* The MLX build this library compiled against, compared with the one
 * loaded (see mlx_build_identity.h). */
#include "fused/mlx_build_identity.h"

#include <link.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "mlx/version.h"

#if !defined(MLX_VERSION_MAJOR) || !defined(MLX_VERSION_MINOR) || !defined(MLX_VERSION_PATCH)
#error "mlx/version.h gives no MLX_VERSION_MAJOR, _MINOR and _PATCH"
#endif

/* build_ffi.py passes the build-id of the libmlx.so it links, as a string
 * literal of lowercase hex; a build that passes none matches no library. */
#ifndef MLX_DUALNORM_MLX_BUILD_ID
#define MLX_DUALNORM_MLX_BUILD_ID ""
#endif

#define MLX_DUALNORM_STRINGIFY_VALUE(value) #value
#define MLX_DUALNORM_STRINGIFY(value) MLX_DUALNORM_STRINGIFY_VALUE(value)

namespace {

/* The version as mlx/version.h gives it, in mlx::core::version()'s form for
 * a release ("major.minor.patch"). */
constexpr char kCompiledVersion[] = MLX_DUALNORM_STRINGIFY(MLX_VERSION_MAJOR) "." MLX_DUALNORM_STRINGIFY(
    MLX_VERSION_MINOR) "." MLX_DUALNORM_STRINGIFY(MLX_VERSION_PATCH);

/* The recorded build-id, kept whole in the library's read-only data behind
 * a fixed prefix, so that a check of a built module (scripts/
 * check_cuda_build.sh) can read it without loading the module. */
#define MLX_DUALNORM_BUILD_ID_RECORD_PREFIX "mlx_dualnorm compiled against libmlx build-id "
constexpr char kRecordPrefix[] = MLX_DUALNORM_BUILD_ID_RECORD_PREFIX;
__attribute__((used)) const char kCompiledBuildIdRecord[] =
    MLX_DUALNORM_BUILD_ID_RECORD_PREFIX MLX_DUALNORM_MLX_BUILD_ID;
static_assert(sizeof(kCompiledBuildIdRecord) >= sizeof(kRecordPrefix));

const char* compiled_build_id() {
  return kCompiledBuildIdRecord + (sizeof(kRecordPrefix) - 1);
}

/* A one-process answer to "which object holds this address, and what is
 * its build-id", filled by dl_iterate_phdr's callback. */
struct BuildIdSearch {
  uintptr_t address = 0;
  std::string build_id;  // lowercase hex; empty where no object or no build-id
};

/* Whether [start, start + size) lies inside a loaded segment that holds
 * file bytes, so that reading it cannot touch unmapped memory. */
bool mapped_from_file(const dl_phdr_info& object, ElfW(Addr) start, ElfW(Xword) size) {
  for (ElfW(Half) index = 0; index < object.dlpi_phnum; ++index) {
    const ElfW(Phdr)& segment = object.dlpi_phdr[index];
    if (segment.p_type == PT_LOAD && start >= segment.p_vaddr &&
        size <= segment.p_filesz && start - segment.p_vaddr <= segment.p_filesz - size) {
      return true;
    }
  }
  return false;
}

std::size_t round_up(std::size_t value, std::size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

/* The GNU build-id among one PT_NOTE segment's notes, as lowercase hex, or
 * empty. Each note is a header and its name, then its descriptor at the
 * next multiple of the segment's alignment (4, or 8 for notes so aligned)
 * from the segment's start, and the next note at the multiple after the
 * descriptor, as the dynamic linker reads them. */
std::string build_id_in_notes(const unsigned char* notes, std::size_t size, std::size_t alignment) {
  constexpr char kHex[] = "0123456789abcdef";
  std::size_t offset = 0;
  while (size - offset >= sizeof(ElfW(Nhdr))) {
    ElfW(Nhdr) header;
    std::memcpy(&header, notes + offset, sizeof(header));
    const std::size_t name_at = offset + sizeof(header);
    if (header.n_namesz > size - name_at) {
      return {};
    }
    const std::size_t description_at = round_up(name_at + header.n_namesz, alignment);
    if (description_at > size || header.n_descsz > size - description_at) {
      return {};
    }
    const unsigned char* name = notes + name_at;
    const unsigned char* description = notes + description_at;
    if (header.n_type == NT_GNU_BUILD_ID && header.n_namesz == sizeof("GNU") &&
        std::memcmp(name, "GNU", sizeof("GNU")) == 0 && header.n_descsz > 0) {
      std::string hex;
      hex.reserve(2 * header.n_descsz);
      for (std::size_t i = 0; i < header.n_descsz; ++i) {
        hex.push_back(kHex[description[i] >> 4]);
        hex.push_back(kHex[description[i] & 0xf]);
      }
      return hex;
    }
    offset = round_up(description_at + header.n_descsz, alignment);
    if (offset > size) {
      return {};
    }
  }
  return {};
}

/* dl_iterate_phdr's callback: stops (returns 1) at the object one of whose
 * loaded segments holds the address searched for, after reading the notes
 * the dynamic linker mapped with it. */
int find_build_id(dl_phdr_info* object, std::size_t, void* data) {
  auto& search = *static_cast<BuildIdSearch*>(data);
  bool holds_address = false;
  for (ElfW(Half) index = 0; index < object->dlpi_phnum && !holds_address; ++index) {
    const ElfW(Phdr)& segment = object->dlpi_phdr[index];
    const uintptr_t start = object->dlpi_addr + segment.p_vaddr;
    holds_address = segment.p_type == PT_LOAD && search.address >= start &&
                    search.address - start < segment.p_memsz;
  }
  if (!holds_address) {
    return 0;
  }
  for (ElfW(Half) index = 0; index < object->dlpi_phnum && search.build_id.empty(); ++index) {
    const ElfW(Phdr)& segment = object->dlpi_phdr[index];
    if (segment.p_type != PT_NOTE || !mapped_from_file(*object, segment.p_vaddr, segment.p_filesz)) {
      continue;
    }
    const auto* notes = reinterpret_cast<const unsigned char*>(object->dlpi_addr + segment.p_vaddr);
    search.build_id = build_id_in_notes(notes, segment.p_filesz, segment.p_align == 8 ? 8 : 4);
  }
  return 1;
}

/* The build-id of the loaded object that defines mlx::core::version (an
 * exported function of libmlx.so; the address this module was linked to),
 * or empty. */
std::string loaded_build_id() {
  BuildIdSearch search;
  search.address = reinterpret_cast<uintptr_t>(&mlx::core::version);
  dl_iterate_phdr(find_build_id, &search);
  return search.build_id;
}

std::string describe(const std::string& version, const std::string& build_id) {
  return "MLX " + version + (build_id.empty() ? " (no build-id)" : " (build-id " + build_id + ")");
}

struct Identities {
  std::string compiled;
  std::string loaded;
  bool matches = false;
};

/* Worked out once per process (a function-local static: thread-safe). A
 * failure to allocate the strings leaves them empty and matches false. */
const Identities& identities() {
  static const Identities found = []() noexcept {
    Identities result;
    try {
      const char* version = mlx::core::version();
      const std::string loaded_version = version != nullptr ? version : "";
      const std::string loaded_id = loaded_build_id();
      const std::string compiled_id = compiled_build_id();
      result.compiled = describe(kCompiledVersion, compiled_id);
      result.loaded = describe(loaded_version.empty() ? "(unknown version)" : loaded_version, loaded_id);
      result.matches = !compiled_id.empty() && compiled_id == loaded_id &&
                       loaded_version == kCompiledVersion;
    } catch (...) {
      result = Identities{};
    }
    return result;
  }();
  return found;
}

} // namespace

extern "C" bool mlx_dualnorm_mlx_build_matches(void) {
  return identities().matches;
}

extern "C" const char* mlx_dualnorm_mlx_build_compiled(void) {
  return identities().compiled.c_str();
}

extern "C" const char* mlx_dualnorm_mlx_build_loaded(void) {
  return identities().loaded.c_str();
}
