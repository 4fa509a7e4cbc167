/* The pod sandbox's first process: it holds the pod's namespaces open and does nothing
 * else. As PID 1 of a pod that shares its PID namespace it reaps orphans, so they do not
 * pile up as zombies. SIGINT and SIGTERM end it (the runtime stops the sandbox so).
 * Built static (`cc -static`): the image holds this file alone. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define PAUSE_VERSION "kxlb-pause 1"

static void stop(int sig)
{
	(void)sig;
	_exit(0);
}

static void reap(int sig)
{
	int saved = errno;

	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0)
		;
	errno = saved;
}

int main(int argc, char **argv)
{
	struct sigaction sa;

	if (argc > 1 && strcmp(argv[1], "-v") == 0) {
		puts(PAUSE_VERSION);
		return 0;
	}
	if (getpid() != 1)
		fprintf(stderr, "pause: warning: not PID 1\n");

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = stop;
	if (sigaction(SIGINT, &sa, NULL) || sigaction(SIGTERM, &sa, NULL))
		return 1;
	sa.sa_handler = reap;
	sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
	if (sigaction(SIGCHLD, &sa, NULL))
		return 2;
	for (;;)
		pause();
}
