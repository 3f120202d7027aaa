// run_compiled: an AOTInductor step run as an op of this library.
#include <torch/csrc/inductor/aoti_runner/model_container_runner_cpu.h>
#include <torch/custom_class.h>
#include <torch/library.h>

namespace flare_native {
namespace {

// torch's Python binding of the AOTInductor runner holds the GIL for the whole step, so the HTTP
// thread cannot stream a token while the next one is computed. Called as an op, the same runner
// runs with the GIL released (torch.ops calls drop it).
struct CompiledStep : torch::CustomClassHolder {
  explicit CompiledStep(const std::string& path) : runner(path, 1) {}
  torch::inductor::AOTIModelContainerRunnerCpu runner;
};

std::vector<at::Tensor> run_compiled(const c10::intrusive_ptr<CompiledStep>& step, const std::vector<at::Tensor>& inputs) {
  return step->runner.run(inputs);
}

}  // namespace
}  // namespace flare_native

TORCH_LIBRARY_FRAGMENT(flare_native, m) {
  m.class_<flare_native::CompiledStep>("CompiledStep").def(torch::init<std::string>());
  m.def("run_compiled(__torch__.torch.classes.flare_native.CompiledStep step, Tensor[] inputs) -> Tensor[]",
        &flare_native::run_compiled);
}
