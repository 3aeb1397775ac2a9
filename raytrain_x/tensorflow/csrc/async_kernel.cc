// raytrain-x's TensorFlow kernels. The asynchronous one, `RaytrainXAsync`, hands its
// inputs to a Python kernel and returns its inter-op thread at once, as Horovod's
// `AsyncOpKernel`s do. The Python side (raytrain_x/tensorflow/kernels.py) runs the kernel
// off TensorFlow's threads (it submits to the engine and waits there) and calls
// `raytrain_x_tf_complete` with the outputs or an error, which finishes the op.
//
// Built on first use against the installed TensorFlow (kernels.py) and loaded with
// `tf.load_op_library`: a session that fetches several collectives, in whatever order
// each rank's executor starts them, no longer holds an inter-op thread per waiting
// collective, so every rank submits them all and the engine negotiates the order.
// `RaytrainXConcat` lays a chunk of gradients out for the engine; both are cheap for the
// executor, so they run as soon as their inputs exist (chunked_reduce.py).

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/types.h"

using tensorflow::AsyncOpKernel;
using tensorflow::DataType;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;

namespace {

// One op in flight, from ComputeAsync until Python completes it.
struct Call {
  OpKernelContext* ctx;
  AsyncOpKernel::DoneCallback done;
};

// (kernel id, call, n inputs, data pointers, dtypes, ranks, dims of all inputs in order)
using Dispatch = void (*)(int64_t, void*, int, const void* const*, const int*, const int*,
                          const int64_t*);
Dispatch g_dispatch = nullptr;

class RaytrainXAsync : public AsyncOpKernel {
 public:
  explicit RaytrainXAsync(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("kernel", &kernel_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cheap", &cheap_));
  }

  // A kernel that only submits to the engine is cheap: the executor then runs it at once,
  // on the thread that produced its last input, instead of queueing it behind backward.
  bool IsExpensive() override { return !cheap_; }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    OP_REQUIRES_ASYNC(ctx, g_dispatch != nullptr,
                      absl::FailedPreconditionError(
                          "raytrain-x's TensorFlow kernels are not registered in this "
                          "process: import raytrain_x.tensorflow before running the graph"),
                      done);
    const int n = ctx->num_inputs();
    std::vector<const void*> data(n);
    std::vector<int> dtypes(n), ranks(n);
    std::vector<int64_t> dims;
    for (int i = 0; i < n; ++i) {
      const Tensor& t = ctx->input(i);
      data[i] = t.tensor_data().data();
      dtypes[i] = static_cast<int>(t.dtype());
      ranks[i] = t.dims();
      for (int d = 0; d < t.dims(); ++d) dims.push_back(t.dim_size(d));
    }
    // Python owns the call until it completes it; the inputs live as long as the context
    g_dispatch(kernel_, new Call{ctx, std::move(done)}, n, data.data(), dtypes.data(),
               ranks.data(), dims.data());
  }

 private:
  int64_t kernel_ = 0;
  bool cheap_ = false;
};

// A chunk's tensors, each flattened and zero-padded to whole rows of `row` elements, back
// to back in a fresh buffer with one more row of zeros at the end (the layout
// chunked_reduce.py splits the results from), and their shapes (each its rank, then its
// dims), which go with the chunk's request: the reduction needs nothing but this op. The
// executor runs it at once, on the thread that produced the chunk's last tensor, so the
// chunk reaches the engine while backward goes on, every step.
class RaytrainXConcat : public OpKernel {
 public:
  explicit RaytrainXConcat(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("row", &row_));
  }

  bool IsExpensive() override { return false; }

  void Compute(OpKernelContext* ctx) override {
    const int n = ctx->num_inputs();
    int64_t elements = row_;  // the closing row
    for (int i = 0; i < n; ++i) elements += Rows(ctx->input(i).NumElements()) * row_;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({elements}), &out));
    char* dst = const_cast<char*>(out->tensor_data().data());
    const size_t item = tensorflow::DataTypeSize(out->dtype());
    for (int i = 0; i < n; ++i) {
      auto src = ctx->input(i).tensor_data();
      const size_t padded = Rows(ctx->input(i).NumElements()) * row_ * item;
      if (!src.empty()) std::memcpy(dst, src.data(), src.size());
      std::memset(dst + src.size(), 0, padded - src.size());
      dst += padded;
    }
    std::memset(dst, 0, row_ * item);
    // the tensors' shapes, each as its rank and its dims (chunked_reduce.py's signature)
    int64_t words = 0;
    for (int i = 0; i < n; ++i) words += 1 + ctx->input(i).dims();
    Tensor* shapes = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({words}), &shapes));
    auto word = shapes->flat<int64_t>();
    int64_t k = 0;
    for (int i = 0; i < n; ++i) {
      const Tensor& t = ctx->input(i);
      word(k++) = t.dims();
      for (int d = 0; d < t.dims(); ++d) word(k++) = t.dim_size(d);
    }
  }

 private:
  int64_t Rows(int64_t count) const { return (count + row_ - 1) / row_; }

  int64_t row_ = 1;
};

}  // namespace

REGISTER_OP("RaytrainXAsync")
    .Input("inputs: Tin")
    .Output("outputs: Tout")
    .Attr("Tin: list(type) >= 0")
    .Attr("Tout: list(type) >= 0")
    .Attr("kernel: int")
    .Attr("cheap: bool = false")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnknownShape);

REGISTER_KERNEL_BUILDER(Name("RaytrainXAsync").Device(tensorflow::DEVICE_CPU), RaytrainXAsync);

// Stateful: two concatenations of the same tensors stay two buffers (the engine writes
// each), and inside tf.function the op keeps its place among the reductions.
REGISTER_OP("RaytrainXConcat")
    .Input("inputs: N * T")
    .Output("output: T")
    .Output("shapes: int64")
    .Attr("T: type")
    .Attr("N: int >= 1")
    .Attr("row: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("RaytrainXConcat").Device(tensorflow::DEVICE_CPU),
                        RaytrainXConcat);

extern "C" {

// Sets the Python function that receives each call.
void raytrain_x_tf_register(Dispatch dispatch) { g_dispatch = dispatch; }

// Finishes `call`: with `code` 0, copies the n outputs (data, ranks, dims of all in order)
// into the op's outputs; else fails the op with that TensorFlow error code and message.
void raytrain_x_tf_complete(void* opaque, int code, const char* message, int n,
                            const void* const* data, const int* ranks, const int64_t* dims) {
  Call* call = static_cast<Call*>(opaque);
  OpKernelContext* ctx = call->ctx;
  if (code != 0) {
    ctx->SetStatus(Status(static_cast<absl::StatusCode>(code), message ? message : ""));
  } else if (n != ctx->num_outputs()) {
    ctx->SetStatus(absl::InternalError("raytrain-x kernel returned " + std::to_string(n) +
                                       " outputs for " + std::to_string(ctx->num_outputs())));
  } else {
    const int64_t* dim = dims;
    for (int i = 0; i < n; ++i) {
      TensorShape shape;
      for (int d = 0; d < ranks[i]; ++d) shape.AddDim(*dim++);
      Tensor* out = nullptr;
      Status s = ctx->allocate_output(i, shape, &out);
      if (!s.ok()) {
        ctx->SetStatus(s);
        break;
      }
      auto bytes = out->tensor_data();
      if (bytes.size() > 0) std::memcpy(const_cast<char*>(bytes.data()), data[i], bytes.size());
    }
  }
  AsyncOpKernel::DoneCallback done = std::move(call->done);
  delete call;
  done();
}

}  // extern "C"
