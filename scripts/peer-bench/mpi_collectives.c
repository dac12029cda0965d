/* Open MPI's own collectives timed as `hetpar bench comm --backend mpi` times hetpar's:
 * f32 buffers of the same sizes, one warm-up call, a barrier, then `iters` calls timed
 * together, the slowest rank's time per call, and bus bandwidth by the nccl-tests factors
 * (crates/hetpar-comm/src/bench.rs). The reference for hetpar's MPI backend, which reduces
 * in member order (an all-to-all, the sums, an all-gather) where MPI_Allreduce picks its
 * own algorithm and order.
 *
 *   mpicc -O2 scripts/peer-bench/mpi_collectives.c -o /tmp/mpi_collectives
 *   mpirun -n 2 /tmp/mpi_collectives [--sizes-mib 4,16,64] [--iters 5]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { ALL_REDUCE, ALL_GATHER, ALL_TO_ALL, SEND_RECV, OPS };
static const char *NAMES[OPS] = {"all-reduce", "all-gather", "all-to-all-v", "send-recv"};

static void run(int op, float *data, float *out, int elems, int n, int me) {
  int part = elems / n, next = (me + 1) % n, prev = (me + n - 1) % n;
  switch (op) {
  case ALL_REDUCE:
    MPI_Allreduce(MPI_IN_PLACE, data, elems, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    break;
  case ALL_GATHER:
    MPI_Allgather(data + (size_t)me * part, part, MPI_FLOAT, out, part, MPI_FLOAT, MPI_COMM_WORLD);
    break;
  case ALL_TO_ALL:
    MPI_Alltoall(data, part, MPI_FLOAT, out, part, MPI_FLOAT, MPI_COMM_WORLD);
    break;
  default:
    MPI_Sendrecv(data, elems, MPI_FLOAT, next, 0, out, elems, MPI_FLOAT, prev, 0, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
  }
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int me, n, iters = 5, sizes[16] = {4, 16, 64}, count = 3;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--iters")) {
      iters = atoi(argv[i + 1]);
    } else if (!strcmp(argv[i], "--sizes-mib")) {
      count = 0;
      for (char *t = strtok(argv[i + 1], ","); t && count < 16; t = strtok(NULL, ","))
        sizes[count++] = atoi(t);
    }
  }
  if (me == 0)
    printf("backend op            ranks       size      time/call algbw GB/s busbw GB/s\n");
  for (int s = 0; s < count; s++) {
    int elems = (int)(((size_t)sizes[s] << 20) / 4);
    elems = (elems < n ? n : elems) / n * n;
    float *data = malloc((size_t)elems * 4), *out = malloc((size_t)elems * 4);
    for (int op = 0; op < OPS; op++) {
      for (int i = 0; i < elems; i++) data[i] = 1.0f, out[i] = 0.0f;
      run(op, data, out, elems, n, me);
      MPI_Barrier(MPI_COMM_WORLD);
      double start = MPI_Wtime();
      for (int i = 0; i < iters; i++) run(op, data, out, elems, n, me);
      double t = (MPI_Wtime() - start) / iters, slowest;
      MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      double algbw = (double)elems * 4 / slowest / 1e9;
      double factor = op == ALL_REDUCE ? 2.0 * (n - 1) / n : op == SEND_RECV ? 1.0 : (double)(n - 1) / n;
      if (me == 0)
        printf("openmpi %-13s %5d %6d MiB %11.3f ms %10.2f %10.2f\n", NAMES[op], n, sizes[s],
               slowest * 1e3, algbw, algbw * factor);
    }
    free(data);
    free(out);
  }
  MPI_Finalize();
  return 0;
}
