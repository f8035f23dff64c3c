// The layer plans with activation qbl::GeluTanh, for every element type (typed_plans.cuh).
#include "typed_plans.cuh"

namespace qbl_torch {
template std::unique_ptr<LayerPlans> make_plans<qbl::GeluTanh>(const Dtypes&, std::int64_t,
                                                               std::int64_t, std::int64_t, bool,
                                                               const qbl::Options&);
}  // namespace qbl_torch
