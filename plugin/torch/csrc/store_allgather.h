// The C API's all-gather callback over a torch Store: how a process group's communicator is created without a
// second rendezvous.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

namespace epcomm_torch {

struct StoreAllgather {
  c10::intrusive_ptr<c10d::Store> store;
  std::string prefix;  // distinct per communicator, so that several can be created on one Store
  int rank = 0;
  int size = 0;
  int round = 0;       // the C API calls the all-gather several times; each call gets its own keys
  std::string error;   // what went wrong, for the exception
};

// epAllgatherFn_t: ctx is a StoreAllgather*.
int storeAllgather(void* ctx, const void* sendbuf, void* recvbuf, size_t bytes_per_rank);

}  // namespace epcomm_torch
