// Python bindings for the fusion core (module raytrain_x._native).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "fusion_buffer.h"
#include "pack.h"
#include "response_cache.h"
#include "shm_group.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace rtx {

bool dtype_from_name(const std::string &name, DType &out) {
    static const std::pair<const char *, DType> table[] = {
        {"float32", DType::Float32}, {"float64", DType::Float64}, {"float16", DType::Float16},
        {"bfloat16", DType::BFloat16}, {"int32", DType::Int32}, {"int64", DType::Int64},
        {"int8", DType::Int8}, {"uint8", DType::UInt8}};
    for (const auto &[n, t] : table)
        if (name == n) { out = t; return true; }
    return false;
}

namespace {

using AnyArray = nb::ndarray<nb::ro>;   // read-only view: pack sources
using OutArray = nb::ndarray<>;         // writable: unpack destinations, pack targets

DType parse_dtype(const std::string &name) {
    DType t;
    if (!dtype_from_name(name, t))
        throw nb::value_error(("unsupported dtype '" + name +
                               "'; use one of float32, float64, float16, bfloat16, int32, "
                               "int64, int8, uint8").c_str());
    return t;
}

std::string label(const std::vector<std::string> &names, std::size_t i) {
    if (i < names.size()) return "tensor '" + names[i] + "' (index " + std::to_string(i) + ")";
    return "tensor at index " + std::to_string(i);
}

template <typename A>
bool array_dtype(const A &a, DType &out) {
    const nb::dlpack::dtype d = a.dtype();
    if (d.lanes != 1) return false;
    using C = nb::dlpack::dtype_code;
    const auto code = static_cast<C>(d.code);
    if (code == C::Float && d.bits == 32) out = DType::Float32;
    else if (code == C::Float && d.bits == 64) out = DType::Float64;
    else if (code == C::Float && d.bits == 16) out = DType::Float16;
    else if (code == C::Bfloat && d.bits == 16) out = DType::BFloat16;
    else if (code == C::Int && d.bits == 32) out = DType::Int32;
    else if (code == C::Int && d.bits == 64) out = DType::Int64;
    else if (code == C::Int && d.bits == 8) out = DType::Int8;
    else if (code == C::UInt && d.bits == 8) out = DType::UInt8;
    else return false;
    return true;
}

template <typename A>
bool is_c_contiguous(const A &a) {
    int64_t expected = 1;
    for (std::size_t d = a.ndim(); d > 0; --d) {
        const int64_t extent = static_cast<int64_t>(a.shape(d - 1));
        if (extent != 1 && a.stride(d - 1) != expected) return false;
        expected *= extent;
    }
    return true;
}

// Validates every tensor and returns their common dtype.
template <typename A>
DType check_tensors(const std::vector<A> &tensors, const std::vector<std::string> &names) {
    if (tensors.empty()) throw nb::value_error("expected at least one tensor, got an empty list");
    DType common = DType::Float32;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
        const A &t = tensors[i];
        if (t.device_type() != nb::device::cpu::value)
            throw nb::value_error((label(names, i) +
                                   " is not in host memory; the native core packs CPU tensors, "
                                   "move it with .cpu() or use the device packer").c_str());
        DType dt;
        if (!array_dtype(t, dt))
            throw nb::value_error((label(names, i) +
                                   " has an unsupported dtype; use float32, float64, float16, "
                                   "bfloat16, int32, int64, int8 or uint8").c_str());
        if (i == 0) common = dt;
        else if (dt != common)
            throw nb::value_error((label(names, i) + " has dtype " + dtype_name(dt) + " but " +
                                   label(names, 0) + " has " + dtype_name(common) +
                                   "; one fused batch holds one dtype").c_str());
        if (!is_c_contiguous(t))
            throw nb::value_error((label(names, i) +
                                   " is not contiguous; call .contiguous() before fusing it").c_str());
    }
    return common;
}

void check_conversion(DType tensor, DType buffer, double scale, const char *what) {
    const bool same = tensor == buffer;
    const bool cast = tensor == DType::Float32 &&
                      (buffer == DType::Float16 || buffer == DType::BFloat16);
    if (!same && !cast)
        throw nb::value_error((std::string(what) + ": tensors are " + dtype_name(tensor) +
                               " but the buffer is " + dtype_name(buffer) +
                               "; the buffer must have the tensors' dtype (or float16/bfloat16 "
                               "for float32 tensors)").c_str());
    if (scale != 1.0 && !is_floating(tensor))
        throw nb::value_error((std::string(what) + ": scale factor " + std::to_string(scale) +
                               " needs floating point tensors, got " + dtype_name(tensor)).c_str());
}

struct Target {
    void *data;
    std::size_t capacity;  // elements
    DType dtype;
};

Target target_of(FusionBuffer &b) { return {b.data(), b.capacity_elements(), b.dtype()}; }

template <typename A>
std::size_t total_elements(const std::vector<A> &tensors) {
    std::size_t n = 0;
    for (const A &t : tensors) n += t.size();
    return n;
}

std::size_t pack_into(const std::vector<AnyArray> &tensors, Target buf, double prescale,
                      std::size_t offset, const std::vector<std::string> &names) {
    const DType dt = check_tensors(tensors, names);
    check_conversion(dt, buf.dtype, prescale, "pack");
    const std::size_t n = total_elements(tensors);
    // compared so that it cannot wrap: offset + n overflows for offsets near 2^64
    if (offset > buf.capacity || n > buf.capacity - offset)
        throw nb::value_error(("pack: buffer too small: needs " + std::to_string(n) +
                               " elements at offset " + std::to_string(offset) + ", holds " +
                               std::to_string(buf.capacity) + "; call reserve() first").c_str());
    std::vector<Segment> segs;
    segs.reserve(tensors.size());
    char *dst = static_cast<char *>(buf.data) + offset * itemsize(buf.dtype);
    for (const AnyArray &t : tensors) {
        segs.push_back({t.data(), dst, t.size()});
        dst += t.size() * itemsize(buf.dtype);
    }
    {
        nb::gil_scoped_release release;
        copy_segments(segs, dt, buf.dtype, prescale, get_num_threads());
    }
    return n;
}

std::size_t unpack_from(Target buf, const std::vector<OutArray> &tensors, double postscale,
                        std::size_t offset, const std::vector<std::string> &names) {
    const DType dt = check_tensors(tensors, names);
    check_conversion(dt, buf.dtype, postscale, "unpack");
    const std::size_t n = total_elements(tensors);
    if (offset > buf.capacity || n > buf.capacity - offset)
        throw nb::value_error(("unpack: buffer too small: needs " + std::to_string(n) +
                               " elements at offset " + std::to_string(offset) + ", holds " +
                               std::to_string(buf.capacity)).c_str());
    std::vector<Segment> segs;
    segs.reserve(tensors.size());
    const char *src = static_cast<const char *>(buf.data) + offset * itemsize(buf.dtype);
    for (const OutArray &t : tensors) {
        segs.push_back({src, t.data(), t.size()});
        src += t.size() * itemsize(buf.dtype);
    }
    {
        nb::gil_scoped_release release;
        copy_segments(segs, buf.dtype, dt, postscale, get_num_threads());
    }
    return n;
}

template <typename A>
Target target_of(A &a, const char *what) {
    DType dt;
    if (a.device_type() != nb::device::cpu::value || !array_dtype(a, dt) || !is_c_contiguous(a))
        throw nb::value_error((std::string(what) +
                               ": the buffer must be a contiguous CPU array of a supported dtype")
                                  .c_str());
    return {const_cast<void *>(a.data()), a.size(), dt};
}

nb::object view_of(FusionBuffer &b, nb::handle owner, std::size_t count) {
    if (count > b.capacity_elements())
        throw nb::value_error(("view of " + std::to_string(count) + " elements exceeds capacity " +
                               std::to_string(b.capacity_elements()) + "; call reserve() first")
                                  .c_str());
    nb::dlpack::dtype d{};
    using C = nb::dlpack::dtype_code;
    d.lanes = 1;
    d.bits = static_cast<uint8_t>(itemsize(b.dtype()) * 8);
    switch (b.dtype()) {
        case DType::Float32: case DType::Float64: case DType::Float16:
            d.code = static_cast<uint8_t>(C::Float); break;
        case DType::BFloat16: d.code = static_cast<uint8_t>(C::Bfloat); break;
        case DType::UInt8: d.code = static_cast<uint8_t>(C::UInt); break;
        default: d.code = static_cast<uint8_t>(C::Int);
    }
    const std::size_t shape[1] = {count};
    return nb::cast(nb::ndarray<>(b.data(), 1, shape, owner, nullptr, d));
}

ReduceOp parse_op(const std::string &name) {
    ReduceOp op;
    if (!reduce_op_from_name(name, op))
        throw nb::value_error(("unsupported reduce op '" + name +
                               "'; use one of sum, min, max, product, band").c_str());
    return op;
}

void shm_allreduce(ShmGroup &g, OutArray a, const std::string &op_name) {
    Target t = target_of(a, "shm allreduce");
    const ReduceOp op = parse_op(op_name);
    nb::gil_scoped_release release;
    g.allreduce(t.data, t.capacity, t.dtype, op);
}

void shm_allreduce_many(ShmGroup &g, const std::vector<OutArray> &arrays, const std::string &op_name,
                        double prescale, double postscale) {
    const std::vector<std::string> names;
    const DType dt = check_tensors(arrays, names);
    const ReduceOp op = parse_op(op_name);
    std::vector<ShmGroup::Piece> pieces;
    pieces.reserve(arrays.size());
    for (const OutArray &a : arrays) pieces.push_back({const_cast<void *>(a.data()), a.size()});
    nb::gil_scoped_release release;
    g.allreduce_many(pieces, dt, op, prescale, postscale);
}

void shm_allgather_shards(ShmGroup &g, OutArray a) {
    Target t = target_of(a, "shm allgather_shards");
    nb::gil_scoped_release release;
    g.allgather_shards(t.data, t.capacity, t.dtype);
}

void shm_reduce_scatter(ShmGroup &g, AnyArray input, OutArray output, const std::string &op_name) {
    Target in = target_of(input, "shm reduce_scatter input");
    Target out = target_of(output, "shm reduce_scatter output");
    if (in.dtype != out.dtype || out.capacity * static_cast<std::size_t>(g.size()) != in.capacity)
        throw nb::value_error("shm reduce_scatter: the output must hold one share of the input, "
                              "of the same dtype");
    const ReduceOp op = parse_op(op_name);
    nb::gil_scoped_release release;
    g.reduce_scatter(in.data, out.data, in.capacity, in.dtype, op);
}

nb::dict entry_to_dict(const CacheEntry &e) {
    nb::dict d;
    d["name"] = e.name;
    d["dtype"] = e.dtype;
    d["shape"] = nb::tuple(nb::cast(e.shape));
    d["op"] = e.op;
    d["slot"] = e.slot;
    return d;
}

}  // namespace
}  // namespace rtx

NB_MODULE(_native, m) {
    using namespace rtx;
    m.doc() = "raytrain-x native fusion core: fusion buffers, pack/unpack, response cache, "
              "shared-memory groups.";
    // At interpreter exit a daemon thread (the engine's cycle, autotune's sampler) may still
    // hold the module's objects: nanobind's leak report then lists every bound function on
    // the user's terminal, about objects the process is releasing anyway.
    nb::set_leak_warnings(false);

    nb::class_<FusionBuffer>(m, "FusionBuffer")
        .def("__init__",
             [](FusionBuffer *self, const std::string &dtype, std::size_t initial_bytes) {
                 new (self) FusionBuffer(parse_dtype(dtype), initial_bytes);
             },
             "dtype"_a, "initial_bytes"_a = 0)
        .def("reserve", &FusionBuffer::reserve, "nbytes"_a)
        .def_prop_ro("dtype", [](const FusionBuffer &b) { return std::string(dtype_name(b.dtype())); })
        .def_prop_ro("itemsize", [](const FusionBuffer &b) { return itemsize(b.dtype()); })
        .def_prop_ro("capacity_bytes", &FusionBuffer::capacity_bytes)
        .def_prop_ro("capacity_elements", &FusionBuffer::capacity_elements)
        .def_prop_ro("allocations", &FusionBuffer::allocations)
        .def_prop_ro("address", [](FusionBuffer &b) { return reinterpret_cast<uintptr_t>(b.data()); })
        .def("view",
             [](nb::handle self, std::size_t count) {
                 return view_of(nb::cast<FusionBuffer &>(self), self, count);
             },
             "count"_a);

    m.def("pack",
          [](const std::vector<AnyArray> &tensors, FusionBuffer &buffer, double prescale,
             std::size_t offset, const std::vector<std::string> &names) {
              return pack_into(tensors, target_of(buffer), prescale, offset, names);
          },
          "tensors"_a, "buffer"_a, "prescale"_a = 1.0, "offset"_a = 0,
          "names"_a = std::vector<std::string>{});
    m.def("pack",
          [](const std::vector<AnyArray> &tensors, OutArray buffer, double prescale,
             std::size_t offset, const std::vector<std::string> &names) {
              return pack_into(tensors, target_of(buffer, "pack"), prescale, offset, names);
          },
          "tensors"_a, "buffer"_a, "prescale"_a = 1.0, "offset"_a = 0,
          "names"_a = std::vector<std::string>{});
    m.def("unpack",
          [](FusionBuffer &buffer, const std::vector<OutArray> &tensors, double postscale,
             std::size_t offset, const std::vector<std::string> &names) {
              return unpack_from(target_of(buffer), tensors, postscale, offset, names);
          },
          "buffer"_a, "tensors"_a, "postscale"_a = 1.0, "offset"_a = 0,
          "names"_a = std::vector<std::string>{});
    m.def("unpack",
          [](AnyArray buffer, const std::vector<OutArray> &tensors, double postscale,
             std::size_t offset, const std::vector<std::string> &names) {
              return unpack_from(target_of(buffer, "unpack"), tensors, postscale, offset, names);
          },
          "buffer"_a, "tensors"_a, "postscale"_a = 1.0, "offset"_a = 0,
          "names"_a = std::vector<std::string>{});
    m.def("get_num_threads", &get_num_threads);
    m.def("set_num_threads", [](int n) {
        if (n < 0) throw nb::value_error("set_num_threads: n must be >= 0 (0 = default)");
        set_num_threads(n);
    }, "n"_a);

    nb::class_<ShmGroup>(m, "ShmGroup")
        .def(nb::init<const std::string &, int, int, std::size_t, bool, double>(), "name"_a,
             "rank"_a, "size"_a, "slot_bytes"_a, "create"_a, "timeout_s"_a)
        .def("unlink", &ShmGroup::unlink)
        .def("peers_visible", &ShmGroup::peers_visible)
        .def("allreduce", &shm_allreduce, "array"_a, "op"_a = "sum")
        .def("allgather_shards", &shm_allgather_shards, "array"_a)
        .def("reduce_scatter", &shm_reduce_scatter, "input"_a, "output"_a, "op"_a = "sum")
        .def("allreduce_many", &shm_allreduce_many, "arrays"_a, "op"_a = "sum",
             "prescale"_a = 1.0, "postscale"_a = 1.0)
        .def("abort", &ShmGroup::abort)
        .def_prop_ro("rank", &ShmGroup::rank)
        .def_prop_ro("size", &ShmGroup::size)
        .def_prop_ro("slot_bytes", &ShmGroup::slot_bytes)
        .def_prop_ro("barriers", &ShmGroup::barriers);

    nb::class_<ResponseCache>(m, "ResponseCache")
        .def(nb::init<std::size_t>(), "capacity"_a)
        .def_prop_ro("capacity", &ResponseCache::capacity)
        .def_prop_ro("words", &ResponseCache::words)
        .def("__len__", &ResponseCache::size)
        .def("__contains__", [](const ResponseCache &c, const std::string &n) { return c.peek(n) != nullptr; })
        .def("put", &ResponseCache::put, "name"_a, "dtype"_a, "shape"_a, "op"_a)
        .def("get",
             [](ResponseCache &c, const std::string &name) -> nb::object {
                 auto e = c.get(name);
                 if (!e) return nb::none();
                 return entry_to_dict(*e);
             },
             "name"_a)
        .def("peek",
             [](const ResponseCache &c, const std::string &name) -> nb::object {
                 const CacheEntry *e = c.peek(name);
                 if (e == nullptr) return nb::none();
                 return entry_to_dict(*e);
             },
             "name"_a)
        .def("slot",
             [](const ResponseCache &c, const std::string &name) {
                 const CacheEntry *e = c.peek(name);
                 return e ? e->slot : int64_t{-1};
             },
             "name"_a)
        .def("erase", &ResponseCache::erase, "name"_a)
        .def("clear", &ResponseCache::clear)
        .def("bits", &ResponseCache::bits, "names"_a)
        .def("entries_for_bits",
             [](const ResponseCache &c, const std::vector<uint64_t> &bits) {
                 nb::list out;
                 for (const CacheEntry &e : c.entries_for_bits(bits)) out.append(entry_to_dict(e));
                 return out;
             },
             "bits"_a)
        .def("names_for_bits", &ResponseCache::names_for_bits, "bits"_a)
        .def("touch_bits", &ResponseCache::touch_bits, "bits"_a)
        .def("lru_order", &ResponseCache::lru_order);
}
