// A send comm and a receive comm of the socket backend connected within this very process, for the unit tests of the
// net backend itself (test_net_scatter, test_net_limits).
#pragma once
#include <cstddef>
#include <string>

#include "common/time.h"
#include "transport/net/net.h"

struct NetPair {
  epcomm::net::NetBackend* net = nullptr;
  void *listen = nullptr, *send = nullptr, *recv = nullptr;
  NetPair() = default;
  NetPair(const NetPair&) = delete;
  NetPair& operator=(const NetPair&) = delete;
  ~NetPair() {
    if (send) net->closeSend(send);
    if (recv) net->closeRecv(recv);
    if (listen) net->closeListen(listen);
  }
};

// Listens, then connects (at most max_streams data streams, 0: the default; pieces of at least min_chunk bytes, 0: the
// default; NetBackend::connectStreams) and accepts: both are non-blocking, so both are called until each gives its
// comm (at most 20 s).
inline bool connectNetPair(NetPair* p, int max_streams = 0, size_t min_chunk = 0) {
  std::string why;
  p->net = epcomm::net::netSocketBackend(&why);
  if (p->net == nullptr) return false;
  uint8_t handle[epcomm::net::kNetHandleSize] = {};
  if (p->net->listen(0, handle, &p->listen) != epSuccess) return false;
  const epcomm::Deadline deadline = epcomm::Deadline::afterMs(20000);
  while ((p->send == nullptr || p->recv == nullptr) && !deadline.expired()) {
    if (p->send == nullptr && p->net->connectStreams(0, handle, {max_streams, min_chunk}, &p->send) != epSuccess)
      return false;
    if (p->recv == nullptr && p->net->accept(p->listen, &p->recv) != epSuccess) return false;
  }
  return p->send != nullptr && p->recv != nullptr;
}

// Tests both requests until both are done (or one fails, or 20 s pass).
inline bool completeBoth(epcomm::net::NetBackend* net, void* sreq, void* rreq, size_t* got) {
  int sdone = 0, rdone = 0;
  const epcomm::Deadline deadline = epcomm::Deadline::afterMs(20000);
  while ((!sdone || !rdone) && !deadline.expired()) {
    if (!sdone && net->test(sreq, &sdone, nullptr) != epSuccess) return false;
    if (!rdone && net->test(rreq, &rdone, got) != epSuccess) return false;
  }
  return sdone && rdone;
}
