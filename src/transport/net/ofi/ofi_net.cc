// Built when libfabric's headers (libfabric-dev) were absent: the ofi backend is not offered.
#include "transport/net/net.h"

namespace epcomm::net {
NetBackend* netOfiBackend(std::string* why) {
  if (why) *why = "epcomm was built without libfabric headers (install libfabric-dev and rebuild)";
  return nullptr;
}
}  // namespace epcomm::net
