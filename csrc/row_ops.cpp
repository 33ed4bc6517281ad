#include "row_ops.h"

namespace tensorfold {
void register_row_ops(nanobind::module_& m) {}
} // namespace tensorfold
