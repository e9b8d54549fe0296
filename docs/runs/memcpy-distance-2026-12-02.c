/* Probe (not part of the build): glibc memcpy of N bytes between two page-aligned buffers,
 * for every destination offset 0..4095 after the source modulo 4 KiB; prints the offsets
 * whose best-of-30 time exceeds 3 us. Build: gcc -O2 memcpy-distance-2026-12-02.c; run:
 * ./a.out 65536 3 (bytes, source offset). On the ninth session's Zen 3 VM (glibc 2.36):
 * offsets 1-31 at 29-42 us against about 1.5 us elsewhere; none with
 * GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=100000000 (no rep movsb). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
int main(int argc,char**argv){
  size_t n = argc>1? atol(argv[1]) : 65536; int srcoff = argc>2? atoi(argv[2]):0;
  char *a = aligned_alloc(4096, (1<<22)); char *b = aligned_alloc(4096, (1<<22));
  memset(a,1,1<<22); memset(b,2,1<<22);
  for (int d=0; d<4096; d++){
    char *src = a + srcoff; char *dst = b + ((srcoff + d) & 4095);
    double best=1e9; for(int r=0;r<30;r++){double t=now(); memcpy(dst,src,n); __asm__ volatile(""::"r"(dst):"memory"); double x=now()-t; if(x<best)best=x;}
    if (best > 3.0) printf("dist %4d : %.2f us\n", d, best);
  }
}
